#!/usr/bin/python3
"""Unary gRPC calls made with Python's grpcio, one after another on one
channel, each with the metadata it is given: the hostile-client cases of
the idemgrpc interceptor (two API keys, one credential spelled several
ways, metadata a handler wrote in upper case, a caller with no
credential).

No generated code: channel.unary_unary with the serializers of
google.protobuf.StringValue, a well-known type that python3-protobuf
ships.

usage: grpc_calls.py TARGET METHOD CALLS_JSON

CALLS_JSON is a list of calls, each {"value": ..., "metadata": [[key,
value], ...]}. Prints one JSON line: a list with, per call, the code's
name ("OK", "UNAUTHENTICATED", ...), the reply, the details of an error,
and the header and trailer metadata as [key, value] pairs (binary
values in hex).
"""
import json
import sys

import grpc
from google.protobuf import wrappers_pb2


def text(v):
    """A metadata value as text: a binary ("-bin") one in hex."""
    return v if isinstance(v, str) else v.hex()


def main():
    target, method, calls = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    results = []
    with grpc.insecure_channel(target) as channel:
        rpc = channel.unary_unary(
            method,
            request_serializer=wrappers_pb2.StringValue.SerializeToString,
            response_deserializer=wrappers_pb2.StringValue.FromString,
        )
        for c in calls:
            out = {"status": "", "value": "", "error": "", "header": [], "trailer": []}
            md = tuple((k, v) for k, v in c["metadata"])
            try:
                reply, call = rpc.with_call(wrappers_pb2.StringValue(value=c["value"]), timeout=10, metadata=md)
                out["status"], out["value"] = "OK", reply.value
            except grpc.RpcError as error:
                call = error
                out["status"], out["error"] = error.code().name, error.details() or ""
            out["header"] = [[k, text(v)] for k, v in (call.initial_metadata() or ())]
            out["trailer"] = [[k, text(v)] for k, v in (call.trailing_metadata() or ())]
            results.append(out)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
