// TcpStore: the rendezvous of ranks in separate processes (issue #22): node 0 serves a key/value
// store on --master-addr:--master-port, every process (node 0 included) is a client of it. The
// multi-process backends use it to hand out the NCCL unique id of rank 0, to publish where each
// CPU rank listens (dist/tcp_communicator.h), the group's layout and the KV page count, and to
// meet at barriers. Called from any thread (one request at a time per client; a wait never holds
// the connection, it polls).
// Invariant: a get() / wait() / barrier() that does not complete before the store's timeout
// returns an error naming the key and the flags; nothing here blocks forever.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/error.h"
#include "dist/tcp_socket.h"

namespace m3::dist {

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // --master-addr
  int port = 29500;                // --master-port (0 with is_server: any free port, for tests)
  bool is_server = false;          // node 0: also serve the store
  double timeout_s = 600.0;        // connecting, and every wait
};

class TcpStore {
 public:
  // The server (is_server) binds host:port first and then connects to itself; a client retries
  // connecting until the timeout. Errors: the address cannot be bound (in use, not this
  // machine's), node 0 unreachable within the timeout (naming --master-addr / --master-port).
  static Result<std::unique_ptr<TcpStore>> create(const TcpStoreOptions& o);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  Status set(const std::string& key, const std::string& value);
  // The value of `key`, waiting until some process sets it (or the timeout).
  Result<std::string> get(const std::string& key);
  // Nonblocking: the value, or "" with *found false.
  Result<std::string> try_get(const std::string& key, bool* found);
  // Adds `delta` to the integer at `key` (0 when unset) and returns the new value.
  Result<int64_t> add(const std::string& key, int64_t delta);
  // Returns once `count` callers have entered barrier(name, count) (any process, any thread).
  Status barrier(const std::string& name, int count);

  int port() const { return port_; }  // the server's port (as bound)
  // This process's IP address as node 0 sees it: where other processes can reach this one.
  std::string local_address() const { return local_address_; }
  double timeout_s() const { return opts_.timeout_s; }

 private:
  TcpStore() = default;
  Result<std::string> request(uint8_t op, const std::string& key, const std::string& value);
  void serve();  // the server thread

  TcpStoreOptions opts_;
  int port_ = 0;
  std::string local_address_;
  std::mutex mu_;  // one request at a time on conn_
  Socket conn_;
  // Server side (node 0 only).
  Socket listener_;
  int wake_[2] = {-1, -1};  // a pipe that ends the server thread
  std::thread server_;
  std::map<std::string, std::string> data_;  // server thread only
};

}  // namespace m3::dist
