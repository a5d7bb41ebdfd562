#include "support/ranks.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "dtrain/launcher.h"

namespace dtrain::testing {

void run_threads(int world_size, const std::function<void(int rank)>& fn) {
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

void run_ranks(int world_size, const std::function<void(Communicator&)>& fn,
               CommunicatorOptions options) {
  auto store = make_memory_store();
  run_threads(world_size, [&](int r) {
    auto comm = make_communicator(store, r, world_size, options);
    fn(*comm);
  });
}

Process spawn_process(const std::vector<std::string>& argv,
                      const std::map<std::string, std::string>& env) {
  static std::atomic<int> counter{0};
  Process p;
  p.log_path = "/tmp/dtrain_test_" + std::to_string(getpid()) + "_" +
               std::to_string(counter.fetch_add(1)) + ".log";

  p.pid = launcher::spawn_process(argv[0], argv, launcher::environment_with(env), p.log_path,
                                  p.log_path);
  return p;
}

ProcessResult wait_process(const Process& p, double timeout_s) {
  ProcessResult r;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  for (;;) {
    pid_t w = waitpid(p.pid, &status, WNOHANG);
    if (w == p.pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      kill(p.pid, SIGKILL);
      waitpid(p.pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  std::ifstream in(p.log_path);
  std::stringstream ss;
  ss << in.rdbuf();
  r.output = ss.str();
  std::remove(p.log_path.c_str());
  return r;
}

std::map<std::string, std::string> rank_env(int rank, int world_size, int port) {
  return {{"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)},
          {"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world_size)},
          {"LOCAL_RANK", std::to_string(rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(world_size)},
          {"OMP_NUM_THREADS", "1"}};
}

}  // namespace dtrain::testing
