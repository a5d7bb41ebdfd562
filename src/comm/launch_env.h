// Parsers for Slurm's compressed lists, used by LaunchInfo::from_env (exposed for tests).
#pragma once

#include <string>
#include <vector>

namespace dtrain::launch_env {

// Expands a tasks-per-node list such as "4(x2),2" into {4, 4, 2}. Throws
// std::invalid_argument on malformed input.
std::vector<int> expand_tasks_per_node(const std::string& list);

// First host of a Slurm hostlist such as "gpu[03-05,9],login1" -> "gpu03" (zero padding
// kept; several bracket groups each take their first value). Throws std::invalid_argument
// on malformed input.
std::string first_host(const std::string& hostlist);

}  // namespace dtrain::launch_env
