// The Gloo full mesh of a job, over connections we make and authenticate.
//
// Gloo's TCP pairs (Gloo 0.5) each listen on a port of their own and take the
// first connection that arrives, unchecked: any local process watching for new
// listeners could connect first, take a peer's place and fail the job (or
// feed it bytes). Instead every task listens on one port of its own, every
// task connects to each lower-ranked task, and both ends prove they hold the
// job token before a connection is used:
//
//   client -> server   hello: "mrdmesh1", client rank, server rank, client nonce (32 bytes)
//   server -> client   server nonce, HMAC(token, "server" | scope | hello | server nonce) (48 bytes)
//   client -> server   HMAC(token, "client" | scope | hello | server nonce) (32 bytes)
//   server -> client   one byte: admitted
//
// Nonces make every proof single-use; the scope ties it to one communicator.
// A connection that fails its proof, breaks the protocol or stays silent past
// kHandshakeLimit is closed and the listener keeps accepting: strangers cost
// the job nothing. The authenticated connections are then handed to Gloo's
// pairs in place of the ones their own listeners would have accepted.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace gloo {
class Context;
}

namespace mirrored::net {

class StoreClient;

// How long one unauthenticated connection may take to present its proof.
constexpr std::chrono::milliseconds kHandshakeLimit{10000};
// Unauthenticated connections held at once; beyond it the oldest is dropped
// (a real peer whose connection is dropped connects again).
constexpr int kMaxPendingConnections = 64;

// Joins the mesh of tasks.size() processes; this process is store.rank().
// Listens on `host` (this task's TF_CONFIG host); keys go under `prefix`.
// Throws PeerTimeout naming the tasks that did not connect within `timeout`,
// PeerLost when a peer is gone or cannot prove it holds the job token.
std::shared_ptr<gloo::Context> connect_mesh(StoreClient& store, const std::string& prefix,
                                            const std::vector<std::string>& tasks, const std::string& host,
                                            std::chrono::milliseconds timeout);

}  // namespace mirrored::net
