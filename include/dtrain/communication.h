// The communication layer: ranks exchanging tensors, and what they agree and count on the
// way. Everything above it (strategies, training utilities, checkpoints) talks through a
// Communicator.
//
//   errors.h        dtrain::Error and its kinds (InvalidArgument, CommError, TimeoutError, ...)
//   work.h          Work: the handle of an asynchronous call (wait with a timeout, then)
//   store.h         Store: the key-value store ranks meet through (in memory, TCP)
//   communicator.h  Communicator: the collectives and point-to-point calls; make_communicator
//   device_mesh.h   DeviceMesh: ranks as replicate x shard plus host groups, made in one place
//   wire_stats.h    the bytes a rank sent, by collective kind and by host
//   comm_hook.h     CommHook: how DataParallel turns a bucket of gradients into their average
//   quantization.h  int8/int4/bf16 wire formats and the hooks that send them
//   powersgd.h      PowerSGD: low-rank gradient compression (a CommHook)
//
// dtrain/mpi.h (a communicator over the application's MPI_Comm) belongs here too, but needs
// <mpi.h>: include it on its own.
#pragma once

#include "dtrain/comm_hook.h"
#include "dtrain/communicator.h"
#include "dtrain/device_mesh.h"
#include "dtrain/errors.h"
#include "dtrain/powersgd.h"
#include "dtrain/quantization.h"
#include "dtrain/store.h"
#include "dtrain/wire_stats.h"
#include "dtrain/work.h"
