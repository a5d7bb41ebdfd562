// The strategies layer: one training loop (Strategy) for every way of spreading a model over
// ranks, on the communication layer (dtrain/communication.h).
//
//   strategy.h       Strategy: forward, backward, parameters, clip_grad_norm, no_sync, finish
//   single_device.h  SingleDevice: the baseline, no communication
//   data_parallel.h  DataParallel (DDP): bucketed gradient all-reduce overlapped with backward
//   fsdp.h           FullyShardedDataParallel: sharded parameters, gradients, optimizer state
//   deferred_init.h  parameters without memory until a strategy materialises its rank's part
//   memory_plan.h    peak memory per rank for each strategy, before the model is built
#pragma once

#include "dtrain/data_parallel.h"
#include "dtrain/deferred_init.h"
#include "dtrain/fsdp.h"
#include "dtrain/memory_plan.h"
#include "dtrain/single_device.h"
#include "dtrain/strategy.h"
