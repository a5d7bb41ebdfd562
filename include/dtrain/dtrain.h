// Everything a training program needs from dtrain, by layer (docs/architecture.md, "The
// public headers, by layer"); include one layer, or one header, for less:
//
//   dtrain/communication.h  communicators, stores, works, errors, gradient hooks
//   dtrain/strategies.h     Strategy: SingleDevice, DataParallel, FullyShardedDataParallel
//   dtrain/training.h       autocast, loss scaling, FusedAdamW, activation checkpointing, ...
//   dtrain/checkpointing.h  checkpoints and their files (safetensors, JSON, CRC-32C)
//   dtrain/launch.h         LaunchInfo and init_communicator, the node launcher, preemption
//
// Left out: dtrain/mpi.h, which needs <mpi.h> (include it yourself, in a build with MPI).
#pragma once

#include "dtrain/checkpointing.h"
#include "dtrain/communication.h"
#include "dtrain/config.h"
#include "dtrain/launch.h"
#include "dtrain/strategies.h"
#include "dtrain/training.h"
