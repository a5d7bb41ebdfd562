// then(work, continuation): the continuation runs once, in wait(); is_completed() and
// exception() never run it and never block (dtrain/work.h), even while another thread runs it.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <stdexcept>
#include <thread>

#include "dtrain/errors.h"
#include "dtrain/work.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;

// An inner call that has already finished, successfully or with `error`.
class FinishedWork final : public Work {
 public:
  explicit FinishedWork(std::exception_ptr error = nullptr) : error_(std::move(error)) {}
  bool is_completed() const override { return true; }
  void wait(std::chrono::milliseconds) override {
    if (error_) std::rethrow_exception(error_);
  }
  std::exception_ptr exception() const override { return error_; }
  uint64_t sequence_number() const override { return 7; }
  const std::string& op_name() const override { return name_; }

 private:
  std::exception_ptr error_;
  std::string name_ = "all_reduce";
};

TEST(ThenWork, PollingNeverRunsTheContinuationWaitRunsItOnce) {
  std::atomic<int> runs{0};
  WorkPtr w = then(std::make_shared<FinishedWork>(), [&] { ++runs; });
  EXPECT_FALSE(w->is_completed());  // the inner call finished, the continuation has not run
  EXPECT_FALSE(w->is_completed());
  EXPECT_EQ(w->exception(), nullptr);
  EXPECT_EQ(runs.load(), 0);
  w->wait();
  w->wait();
  EXPECT_EQ(runs.load(), 1);
  EXPECT_TRUE(w->is_completed());
  EXPECT_EQ(w->sequence_number(), 7u);
  EXPECT_EQ(w->op_name(), "all_reduce");
}

TEST(ThenWork, IsCompletedDoesNotBlockWhileAnotherThreadRunsTheContinuation) {
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  WorkPtr w = then(std::make_shared<FinishedWork>(), [&entered, released] {
    entered.set_value();
    released.wait();  // e.g. a hook's continuation waiting for a broadcast
  });
  std::thread waiter([w] { w->wait(); });
  entered.get_future().wait();
  // Polled from a third thread, so that a call that blocks is seen without hanging the test.
  bool completed = true;
  std::exception_ptr error;
  std::promise<void> polled;
  std::future<void> polled_done = polled.get_future();
  std::thread poller([&] {
    completed = w->is_completed();
    error = w->exception();
    polled.set_value();
  });
  const bool prompt = polled_done.wait_for(2s) == std::future_status::ready;
  release.set_value();
  waiter.join();
  poller.join();
  EXPECT_TRUE(prompt) << "is_completed() or exception() blocked while the continuation ran";
  EXPECT_FALSE(completed);
  EXPECT_EQ(error, nullptr);
  EXPECT_TRUE(w->is_completed());
}

TEST(ThenWork, FailedInnerWorkCompletesAtOnceWithoutTheContinuation) {
  bool ran = false;
  auto failure = std::make_exception_ptr(CommError("peer closed the connection"));
  WorkPtr w = then(std::make_shared<FinishedWork>(failure), [&] { ran = true; });
  EXPECT_TRUE(w->is_completed());
  EXPECT_EQ(w->exception(), failure);
  EXPECT_THROW(w->wait(), CommError);
  EXPECT_FALSE(ran);
}

TEST(ThenWork, ContinuationFailureIsTheWorksFailure) {
  WorkPtr w = then(std::make_shared<FinishedWork>(), [] { throw std::runtime_error("copy-back"); });
  EXPECT_THROW(w->wait(), std::runtime_error);
  EXPECT_TRUE(w->is_completed());
  ASSERT_NE(w->exception(), nullptr);
  EXPECT_THROW(w->wait(), std::runtime_error);  // sticky: the continuation does not run again
  EXPECT_THROW(then(nullptr, [] {}), InvalidArgument);
}

}  // namespace
}  // namespace dtrain
