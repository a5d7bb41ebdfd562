// Command lines of dtrain's own programs (dtrain-run, the benchmarks) on Abseil flags, the
// flags library gpt2_train uses: every flag is an ABSL_FLAG (typed, with its default and help
// text), parsed by Abseil. Only the walk over argv is here, because those programs need two
// things absl::ParseCommandLine cannot give: stopping at the program dtrain-run is to run
// (whose own flags follow it), and usage errors that throw (the programs exit with status 2,
// Abseil's parser would exit(1) itself).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace dtrain::cli {

enum class Positional {
  kStop,    // the first argument that is not a flag ends the flags (dtrain-run's program)
  kReject,  // every argument must be a flag
};

// Sets this program's Abseil flags from args[first..]: `--name=value`, `--name value`, and
// `--name` alone for a bool flag (true). "--" ends the flags and is consumed. Returns the
// index of the first argument after the flags (args.size() when none is left). Throws
// std::invalid_argument naming the argument: an unknown flag, a missing value, a value the
// flag's type rejects (with Abseil's reason), or a positional argument under kReject.
size_t parse_flags(const std::vector<std::string>& args, size_t first, Positional positional);

// Every flag of this program with its default and help text, grouped by the source file that
// defines it:
//   flags of bench_collectives.cpp:
//     --max_bytes=<value>  (default 268435456)
//         largest message, bytes
std::string flags_help();

}  // namespace dtrain::cli
