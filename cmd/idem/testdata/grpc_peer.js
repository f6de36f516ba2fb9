// A gRPC peer in Node (@grpc/grpc-js) for cmd/idem's gRPC tests, without
// generated stubs: a service definition on raw Buffers. The same roles and
// service as grpc_peer.py:
//
//   node grpc_peer.js server         prints {"listen": PORT}, then one JSON
//                                    line per execution of Do
//   node grpc_peer.js client ADDR C  makes the call C and prints its result
'use strict';
const grpc = require('@grpc/grpc-js');

const raw = { requestSerialize: (b) => b, requestDeserialize: (b) => b, responseSerialize: (b) => b, responseDeserialize: (b) => b };
const service = {
  Do: { path: '/idem.Test/Do', requestStream: false, responseStream: false, ...raw },
  Open: { path: '/idem.Test/Open', requestStream: false, responseStream: false, ...raw },
  Watch: { path: '/idem.Test/Watch', requestStream: false, responseStream: true, ...raw },
  Chat: { path: '/idem.Test/Chat', requestStream: true, responseStream: true, ...raw },
};

const runs = new Map();
const gates = new Map();
function gate(name) {
  if (!gates.has(name)) {
    let open;
    const p = new Promise((resolve) => { open = resolve; });
    gates.set(name, { p, open });
  }
  return gates.get(name);
}

function serve() {
  const server = new grpc.Server();
  server.addService(service, {
    Do: async (call, callback) => {
      const msg = call.request.toString();
      const key = (call.metadata.get('idempotency-key')[0] || '').toString();
      const n = (runs.get(key) || 0) + 1;
      runs.set(key, n);
      console.log(JSON.stringify({ key, msg }));
      const header = new grpc.Metadata();
      header.set('x-server', 'node');
      call.sendMetadata(header);
      const trailer = new grpc.Metadata();
      trailer.set('x-run', String(n));
      trailer.set('x-deadline', call.getDeadline() === Infinity ? 'no' : 'yes');
      if (msg.startsWith('hold:')) await gate(msg.slice(5)).p;
      if (msg.startsWith('status:')) {
        callback({ code: Number(msg.slice(7)), details: 'failed ' + msg, metadata: trailer });
        return;
      }
      callback(null, Buffer.from(`reply:${msg}:${n}`), trailer);
    },
    Open: (call, callback) => { gate(call.request.toString()).open(); callback(null, Buffer.from('opened')); },
    Watch: (call) => {
      for (let i = 0; i < 3; i++) call.write(Buffer.from(`${call.request.toString()}:${i}`));
      call.end();
    },
    Chat: (call) => {
      call.on('data', (b) => call.write(Buffer.concat([Buffer.from('chat:'), b])));
      call.on('end', () => call.end());
    },
  });
  server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (err, port) => {
    if (err) throw err;
    console.log(JSON.stringify({ listen: port }));
  });
}

function client(addr, spec) {
  const c = JSON.parse(spec);
  const Client = grpc.makeGenericClientConstructor(service, 'Test');
  const client = new Client(addr, grpc.credentials.createInsecure());
  const md = new grpc.Metadata();
  if (c.key) md.set('idempotency-key', c.key);
  const opts = c.timeout ? { deadline: new Date(Date.now() + c.timeout * 1000) } : {};
  const out = { msgs: [], header: {}, trailer: {} };
  const name = c.method.split('/').pop();
  const mdObject = (m) => Object.fromEntries(Object.entries(m.getMap()).filter(([k]) => !k.endsWith('-bin')).map(([k, v]) => [k, v.toString()]));
  const done = (status) => {
    out.code = status.code;
    if (status.code !== 0) out.message = status.details;
    out.trailer = mdObject(status.metadata);
    console.log(JSON.stringify(out));
    client.close();
  };
  let call;
  if (service[name].responseStream) {
    call = client[name](Buffer.from(c.msg), md, opts);
    call.on('data', (b) => out.msgs.push(b.toString('base64')));
    call.on('error', () => {});
  } else {
    call = client[name](Buffer.from(c.msg), md, opts, (err, resp) => { if (!err) out.msgs.push(resp.toString('base64')); });
  }
  call.on('metadata', (m) => { out.header = mdObject(m); });
  call.on('status', (s) => setImmediate(() => done(s)));
}

if (process.argv[2] === 'server') serve();
else client(process.argv[3], process.argv[4]);
