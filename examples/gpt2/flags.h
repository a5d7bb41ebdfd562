// gpt2_train's command line: the flags (defined in flags.cpp, the only file that reads
// them) and their translation into a checked Config.
#pragma once

#include <vector>

#include "train_config.h"

namespace gpt2 {

// Sets the usage text (--help lists flags.cpp's flags) and parses argv with Abseil, which
// exits on --help and on unknown flags. Returns the positional arguments (argv[0] first).
std::vector<char*> parse_command_line(int argc, char** argv);

// The parsed flags as a Config. Throws dtrain::InvalidArgument naming the first bad flag.
Config config_from_flags();

}  // namespace gpt2
