// SIGTERM/SIGINT as a request to stop after the current step (with --ckpt_dir: after writing
// a checkpoint), as a scheduler sends before preemption.
#pragma once

namespace gpt2 {

// Makes SIGTERM and SIGINT set the value stop_signal() returns instead of killing the process.
void install_stop_handlers();

// The SIGTERM/SIGINT received since install_stop_handlers() (0: none). The training loop
// reads it once per step and the ranks agree on it in the step's all-gather.
int stop_signal();

}  // namespace gpt2
