// A dtrain::Store (dtrain/store.h) kept in an external etcd server, so that the job's store
// outlives the loss of any of its hosts, rank 0's included. connect_store uses it when
// LaunchInfo::rdzv_backend is kEtcd (dtrain-run --rdzv_backend etcd, docs/multinode.md).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "dtrain/store.h"

namespace dtrain {

struct EtcdStoreOptions {
  // The etcd server's client endpoints, "host:port" or "http://host:port", several separated
  // by commas (members of one etcd cluster: a request that cannot reach one tries the next).
  std::string endpoints;
  // Every key is stored in etcd as key_prefix + key. Must not be empty: it keeps runs sharing
  // one etcd apart (connect_store uses "/dtrain/<run id>/<generation>/").
  std::string key_prefix;
  // Bound on reaching etcd when the store is made and on each call; get and wait are bounded
  // by their own timeout instead. An unreachable or failing etcd is retried until then.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
};

// A store kept in an external etcd server (etcd v3, through its HTTP/JSON gateway: plain
// HTTP, no TLS, no authentication). Its keys outlive every process of the job, so losing any
// host, rank 0's included, loses nothing the store holds. get and wait poll with backoff
// (at most 100 ms apart); add is a compare-and-swap transaction on the key's revision.
// Values are limited by etcd's request size (--max-request-bytes, 1.5 MiB by default,
// base64 makes a value a third larger); a larger one fails with CommError saying so.
// Throws dtrain::TimeoutError when etcd cannot be reached within options.timeout,
// InvalidArgument for malformed options; every error names the operation, the key and the
// endpoint. network_address() is the local end of the connection to etcd.
std::shared_ptr<Store> make_etcd_store(const EtcdStoreOptions& options);

}  // namespace dtrain
