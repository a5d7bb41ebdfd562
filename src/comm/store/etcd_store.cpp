// dtrain::Store kept in an external etcd server, through etcd v3's HTTP/JSON gateway
// (POST /v3/kv/put, /v3/kv/range, /v3/kv/txn; keys and values base64).
//
// Retries: a request that certainly did not reach etcd (refused or broken connection before
// the whole request was sent) or that etcd refused before proposing it (no leader, too many
// requests) is retried with backoff until the call's deadline, on the next endpoint. A put or range
// whose answer was lost is simply repeated (both are idempotent); a lost answer to add's
// transaction is not, because it may have been applied: that add throws CommError rather
// than risk counting twice.
#include <algorithm>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "comm/net/address.h"
#include "comm/store/etcd_http.h"
#include "dtrain/errors.h"
#include "dtrain/etcd_store.h"
#include "dtrain/json.h"
#include "dtrain/store.h"

namespace dtrain {
namespace {

using detail::Clock;
using std::chrono::milliseconds;

constexpr milliseconds kMaxPoll{100};
// etcd refuses a transaction with more operations than --max-txn-ops (128 by default).
constexpr size_t kKeysPerTxn = 64;

// Whether an error answer may be retried. Unavailable (14) covers "no leader" but also
// "request timed out", which may still be applied: only an idempotent request retries it.
// ResourceExhausted (8, "too many requests") and "no leader" are refused before the request
// is proposed.
bool retryable(int64_t grpc_code, const std::string& message, bool idempotent) {
  if (grpc_code == 8 || message.find("no leader") != std::string::npos) return true;
  return idempotent && grpc_code == 14;
}

int64_t json_int(const Json& j, std::string_view key) {
  const Json* v = j.find(key);
  if (v == nullptr) return 0;  // the gateway leaves zero values out
  if (v->is_int()) return v->as_int();
  return std::stoll(v->as_string());  // int64 fields are JSON strings
}

struct Kv {
  Bytes value;
  int64_t mod_revision = 0;
};

class EtcdStore final : public Store {
 public:
  explicit EtcdStore(const EtcdStoreOptions& o)
      : options_(o), http_(parse(o)), endpoints_text_(o.endpoints) {
    // A status request proves the endpoint speaks etcd v3's gateway before anyone relies on it.
    const Json status = call("etcd_store.connect", "", "/v3/maintenance/status", Json::object(),
                             Clock::now() + o.timeout, true);
    if (status.find("version") == nullptr) {
      throw CommError(ctx("etcd_store.connect"),
                      fmt::format("{} answered a status request without a version: is it an "
                                  "etcd v3 client URL?",
                                  where()));
    }
    network_address_ = http_.local_address();
    // As for the TCP store: a loopback end of a connection to a non-loopback name cannot be
    // reached by peers on other hosts.
    if (net::is_loopback_host(network_address_) && !net::is_loopback_host(http_.endpoint().host)) {
      const std::string external = net::first_external_address();
      if (!external.empty()) network_address_ = external;
    }
  }

  std::string network_address() const override { return network_address_; }

  void set(const std::string& key, const Bytes& value) override {
    Json put = Json::object();
    put.set("key", encode_key(key));
    put.set("value", detail::base64_encode(as_view(value)));
    call("store.set", key, "/v3/kv/put", put, Clock::now() + options_.timeout, true);
  }

  Bytes get(const std::string& key, milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    auto backoff = milliseconds(1);
    for (;;) {
      if (std::optional<Kv> kv = range("store.get", key, request_deadline(deadline)))
        return std::move(kv->value);
      if (Clock::now() >= deadline) {
        throw TimeoutError(ctx("store.get"),
                           fmt::format("key '{}' not set within {} ms (etcd at {})", key,
                                       timeout.count(), where()));
      }
      sleep(backoff, deadline);
    }
  }

  int64_t add(const std::string& key, int64_t delta) override {
    const auto deadline = Clock::now() + options_.timeout;
    // Compare-and-swap on the key's revision; the failure branch reads the current value, so
    // a lost race costs one round trip.
    int64_t revision = 0, current = 0;
    auto backoff = milliseconds(1);
    for (;;) {
      const int64_t next = current + delta;
      const std::string text = std::to_string(next);
      Json cmp = Json::object();
      cmp.set("key", encode_key(key));
      cmp.set("target", "MOD");
      cmp.set("result", "EQUAL");
      cmp.set("mod_revision", std::to_string(revision));
      Json put = Json::object();
      put.set("key", encode_key(key));
      put.set("value", detail::base64_encode(text));
      Json txn = Json::object();
      txn.set("compare", Json::Array{cmp});
      txn.set("success", Json::Array{wrap("request_put", put)});
      txn.set("failure", Json::Array{wrap("request_range", key_only(key))});
      const Json r = call("store.add", key, "/v3/kv/txn", txn, deadline, false);
      if (const Json* ok = r.find("succeeded"); ok != nullptr && ok->as_bool()) return next;
      const std::optional<Kv> kv =
          first_kv(response_range(r, 0, "store.add", key), "store.add", key);
      if (!kv) {
        revision = current = 0;
      } else {
        revision = kv->mod_revision;
        current = to_int(kv->value, key);
      }
      if (Clock::now() >= deadline) {
        throw TimeoutError(ctx("store.add"), fmt::format("key '{}' kept changing under "
                                                         "concurrent adds for {} ms (etcd at {})",
                                                         key, options_.timeout.count(), where()));
      }
      if (backoff > milliseconds(1)) sleep(backoff, deadline);
      backoff = std::min(backoff * 2, milliseconds(20));
    }
  }

  void wait(const std::vector<std::string>& keys, milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    auto backoff = milliseconds(1);
    for (;;) {
      const std::optional<std::string> missing =
          first_missing("store.wait", keys, request_deadline(deadline));
      if (!missing) return;
      if (Clock::now() >= deadline) {
        throw TimeoutError(ctx("store.wait"),
                           fmt::format("key '{}' not set within {} ms (etcd at {})", *missing,
                                       timeout.count(), where()));
      }
      sleep(backoff, deadline);
    }
  }

  bool check(const std::vector<std::string>& keys) override {
    return !first_missing("store.check", keys, Clock::now() + options_.timeout);
  }

 private:
  static std::vector<detail::EtcdEndpoint> parse(const EtcdStoreOptions& o) {
    const ErrorContext c{-1, -1, "make_etcd_store", -1};
    if (o.key_prefix.empty())
      throw InvalidArgument(c,
                            "EtcdStoreOptions::key_prefix is empty: runs sharing the etcd "
                            "would read each other's keys");
    if (o.timeout <= milliseconds(0))
      throw InvalidArgument(
          c, fmt::format("EtcdStoreOptions::timeout {} ms must be positive", o.timeout.count()));
    try {
      return detail::parse_etcd_endpoints(o.endpoints);
    } catch (const std::invalid_argument& e) {
      throw InvalidArgument(c, e.what());
    }
  }

  static std::string_view as_view(const Bytes& b) {
    return {reinterpret_cast<const char*>(b.data()), b.size()};
  }
  static Json wrap(const char* name, Json inner) {
    Json j = Json::object();
    j.set(name, std::move(inner));
    return j;
  }
  std::string encode_key(const std::string& key) const {
    return detail::base64_encode(options_.key_prefix + key);
  }
  Json key_only(const std::string& key) const {
    Json j = Json::object();
    j.set("key", encode_key(key));
    return j;
  }

  static ErrorContext ctx(const char* op) { return ErrorContext{-1, -1, op, -1}; }
  std::string where() const {
    std::lock_guard<std::mutex> lock(mu_);
    return http_.endpoint().text();
  }

  // A request made while polling may finish a little after the poll's own deadline, so that a
  // short timeout still gets one answer; never later than the store's timeout allows.
  Clock::time_point request_deadline(Clock::time_point poll_deadline) const {
    return std::max(poll_deadline, Clock::now() + std::min(options_.timeout, milliseconds(1000)));
  }

  static void sleep(milliseconds& backoff, Clock::time_point deadline) {
    const auto left = deadline - Clock::now();
    if (left > Clock::duration::zero())
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, left));
    backoff = std::min(backoff * 2, kMaxPoll);
  }

  int64_t to_int(const Bytes& value, const std::string& key) const {
    const std::string s(value.begin(), value.end());
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(s, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != s.size()) {
      throw InvalidArgument(ctx("store.add"),
                            fmt::format("key '{}' holds '{}', not an integer (etcd at {})", key,
                                        s.substr(0, 40), where()));
    }
    return v;
  }

  // The key of a range answer, if it has one; a malformed answer is a CommError.
  std::optional<Kv> first_kv(const Json* range_response, const char* op,
                             const std::string& key) const {
    try {
      if (range_response == nullptr) return std::nullopt;
      const Json* kvs = range_response->find("kvs");
      if (kvs == nullptr || kvs->as_array().empty()) return std::nullopt;
      const Json& kv = kvs->as_array().front();
      Kv out;
      if (const Json* v = kv.find("value")) {  // absent for an empty value
        const std::string raw = detail::base64_decode(v->as_string());
        out.value.assign(raw.begin(), raw.end());
      }
      out.mod_revision = json_int(kv, "mod_revision");
      return out;
    } catch (const std::exception& e) {
      throw CommError(ctx(op), fmt::format("key '{}': etcd at {} answered a range that cannot be "
                                           "read: {}",
                                           key, where(), e.what()));
    }
  }

  // The i-th response of a transaction, which must be a range.
  const Json* response_range(const Json& txn, size_t i, const char* op,
                             const std::string& key) const {
    const Json* rs = txn.find("responses");
    if (rs == nullptr || rs->as_array().size() <= i ||
        rs->as_array()[i].find("response_range") == nullptr) {
      throw CommError(ctx(op), fmt::format("key '{}': etcd at {} answered a transaction without "
                                           "its range response",
                                           key, where()));
    }
    return rs->as_array()[i].find("response_range");
  }

  std::optional<Kv> range(const char* op, const std::string& key, Clock::time_point deadline) {
    const Json r = call(op, key, "/v3/kv/range", key_only(key), deadline, true);
    return first_kv(&r, op, key);
  }

  // One transaction of ranges per kKeysPerTxn keys; the first key not set, if any.
  std::optional<std::string> first_missing(const char* op, const std::vector<std::string>& keys,
                                           Clock::time_point deadline) {
    for (size_t begin = 0; begin < keys.size(); begin += kKeysPerTxn) {
      const size_t end = std::min(keys.size(), begin + kKeysPerTxn);
      Json::Array reads;
      for (size_t i = begin; i < end; ++i) {
        Json r = key_only(keys[i]);
        r.set("keys_only", true);
        reads.push_back(wrap("request_range", std::move(r)));
      }
      Json txn = Json::object();
      txn.set("success", std::move(reads));
      const Json r = call(op, keys[begin], "/v3/kv/txn", txn, deadline, true);
      for (size_t i = begin; i < end; ++i) {
        const Json* kvs = response_range(r, i - begin, op, keys[i])->find("kvs");
        if (kvs == nullptr || kvs->as_array().empty()) return keys[i];
      }
    }
    return std::nullopt;
  }

  // One request, retried while it certainly was not applied (and, when idempotent, whenever
  // its answer was lost) until the deadline. Returns the parsed answer of an HTTP 200.
  Json call(const char* op, const std::string& key, const char* path, const Json& body,
            Clock::time_point deadline, bool idempotent) {
    const std::string text = body.dump();
    const std::string what = key.empty() ? std::string() : fmt::format("key '{}': ", key);
    const auto start = Clock::now();
    auto backoff = milliseconds(5);
    std::string last;
    for (;;) {
      std::string endpoint;
      detail::HttpResponse resp;
      try {
        std::lock_guard<std::mutex> lock(mu_);
        endpoint = http_.endpoint().text();
        resp = http_.post(path, text, deadline);
      } catch (const detail::HttpFailure& e) {
        if (e.sent() && !idempotent) {
          throw CommError(ctx(op), fmt::format("{}the connection to etcd at {} failed after the "
                                               "request was sent ({}); whether it was applied is "
                                               "unknown",
                                               what, endpoint, e.what()));
        }
        last = fmt::format("etcd at {}: {}", endpoint, e.what());
        if (Clock::now() >= deadline) {
          throw TimeoutError(
              ctx(op),
              fmt::format("{}etcd did not answer for {} ms ({}; endpoints {})", what,
                          std::chrono::duration_cast<milliseconds>(Clock::now() - start).count(),
                          last, endpoints_text_));
        }
        sleep(backoff, deadline);
        continue;
      }
      if (resp.status == 200) {
        try {
          return Json::parse(resp.body);
        } catch (const JsonError& e) {
          throw CommError(ctx(op), fmt::format("{}etcd at {} answered {} with invalid JSON: {}",
                                               what, endpoint, path, e.cause()));
        }
      }
      std::string message = resp.body.substr(0, 300);
      int64_t code = -1;
      try {
        const Json err = Json::parse(resp.body);
        if (const Json* m = err.find("message"); m != nullptr && m->is_string())
          message = m->as_string();
        code = json_int(err, "code");
      } catch (const std::exception&) {
      }
      if (retryable(code, message, idempotent) && Clock::now() < deadline) {
        last = message;
        sleep(backoff, deadline);
        continue;
      }
      std::string hint;
      if (message.find("too large") != std::string::npos)
        hint =
            " (values are limited by etcd's --max-request-bytes, 1.5 MiB by default; base64 "
            "adds a third)";
      if (resp.status == 404)
        hint = " (is it an etcd v3 client URL? the v3 JSON gateway serves /v3/kv/...)";
      throw CommError(ctx(op), fmt::format("{}etcd at {} refused {}: HTTP {}: {}{}", what, endpoint,
                                           path, resp.status, message, hint));
    }
  }

  const EtcdStoreOptions options_;
  mutable std::mutex mu_;  // one request at a time on the connection
  detail::HttpClient http_;
  const std::string endpoints_text_;
  std::string network_address_;
};

}  // namespace

std::shared_ptr<Store> make_etcd_store(const EtcdStoreOptions& options) {
  return std::make_shared<EtcdStore>(options);
}

}  // namespace dtrain
