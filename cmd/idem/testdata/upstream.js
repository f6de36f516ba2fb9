// A keep-alive upstream on Node's http module. It prints {"listen": PORT}
// once, then one JSON line per execution on stdout; a request Node cannot
// parse goes to stderr. Used by cmd/idem's upstream framing tests.
const http = require('http');
const crypto = require('crypto');

const runs = new Map();
const server = http.createServer((req, res) => {
  const chunks = [];
  req.on('data', (c) => chunks.push(c));
  req.on('end', () => {
    const body = Buffer.concat(chunks);
    const key = req.headers['idempotency-key'] || '';
    const run = (runs.get(key) || 0) + 1;
    runs.set(key, run);
    console.log(JSON.stringify({ key, run, len: body.length }));
    const out = JSON.stringify({
      key, run, len: body.length,
      sha256: crypto.createHash('sha256').update(body).digest('hex'),
    });
    res.writeHead(201, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(out) });
    res.end(out);
  });
});
server.on('clientError', (err, socket) => {
  process.stderr.write('upstream error: ' + err.message + '\n');
  socket.destroy();
});
server.keepAliveTimeout = 60000;
server.listen(0, '127.0.0.1', () => {
  console.log(JSON.stringify({ listen: server.address().port }));
});
