"""The wire, shared by the gRPC server and its client: one home for each of its rules.

::

    codec       core values <-> hkv.v1 protobuf messages, both directions (a round trip is
                tested once); packed handle columns, enums, lookup replies as bytes
    status_map  the one table from hkv's error tree to gRPC status codes, and back
    rpc         RpcFailed: the client's error for a failure with no domain meaning

The server (``hkv_service.server``) and the client (``hkv_service.client``) both import this
package; neither imports the other.
"""
