// dtrain-supervise: the supervisor dtrain-run and dtrain::launcher::run_node start for each
// rank (launcher/supervisor.h has the protocol). Not meant to be run by hand.
//
//   dtrain-supervise LAUNCHER_PID -- PROGRAM ARGS...    (descriptor 3: the report pipe)
#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "launcher/supervisor.h"

int main(int argc, char** argv) {
  char* end = nullptr;
  errno = 0;
  const long launcher = argc > 1 ? std::strtol(argv[1], &end, 10) : 0;
  if (argc < 4 || end == argv[1] || *end != '\0' || errno != 0 || launcher <= 0 ||
      std::string(argv[2]) != "--") {
    fmt::print(stderr,
               "usage: dtrain-supervise LAUNCHER_PID -- PROGRAM [ARGS...] (started by "
               "dtrain-run and dtrain::launcher::run_node, with a report pipe on "
               "descriptor 3)\n");
    return 2;
  }
  const std::vector<std::string> command(argv + 3, argv + argc);
  return dtrain::launcher::supervise(static_cast<pid_t>(launcher), command);
}
