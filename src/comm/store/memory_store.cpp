#include <condition_variable>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "dtrain/errors.h"
#include "dtrain/store.h"

namespace dtrain {
namespace {

class MemoryStore final : public Store {
 public:
  void set(const std::string& key, const Bytes& value) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      data_[key] = value;
    }
    cv_.notify_all();
  }

  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    wait_locked(lock, {key}, timeout, "store.get");
    return data_.at(key);
  }

  int64_t add(const std::string& key, int64_t delta) override {
    int64_t value = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = data_.find(key);
      if (it != data_.end()) value = std::stoll(std::string(it->second.begin(), it->second.end()));
      value += delta;
      std::string s = std::to_string(value);
      data_[key] = Bytes(s.begin(), s.end());
    }
    cv_.notify_all();
    return value;
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    wait_locked(lock, keys, timeout, "store.wait");
  }

  bool check(const std::vector<std::string>& keys) override {
    std::lock_guard<std::mutex> lock(mu_);
    return all_set(keys);
  }

 private:
  bool all_set(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (data_.count(k) == 0) return false;
    return true;
  }

  void wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                   std::chrono::milliseconds timeout, const char* op) {
    if (!cv_.wait_for(lock, timeout, [&] { return all_set(keys); })) {
      throw TimeoutError(ErrorContext{-1, -1, op, -1}, fmt::format("key '{}' not set within {} ms",
                                                                   keys.front(), timeout.count()));
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Bytes> data_;
};

class PrefixStore final : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base)
      : prefix_(std::move(prefix) + "/"), base_(std::move(base)) {}

  void set(const std::string& key, const Bytes& value) override {
    base_->set(prefix_ + key, value);
  }
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
    return base_->get(prefix_ + key, timeout);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    return base_->add(prefix_ + key, delta);
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    base_->wait(prefixed(keys), timeout);
  }
  bool check(const std::vector<std::string>& keys) override { return base_->check(prefixed(keys)); }
  std::string network_address() const override { return base_->network_address(); }

 private:
  std::vector<std::string> prefixed(const std::vector<std::string>& keys) const {
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& k : keys) out.push_back(prefix_ + k);
    return out;
  }

  std::string prefix_;
  std::shared_ptr<Store> base_;
};

}  // namespace

std::shared_ptr<Store> make_memory_store() { return std::make_shared<MemoryStore>(); }

std::shared_ptr<Store> make_prefix_store(std::string prefix, std::shared_ptr<Store> base) {
  if (!base) throw InvalidArgument("make_prefix_store: base store is null");
  return std::make_shared<PrefixStore>(std::move(prefix), std::move(base));
}

}  // namespace dtrain
