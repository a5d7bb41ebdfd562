// Umbrella header: everything a training program needs from dtrain.
#pragma once

#include "dtrain/activation_checkpoint.h"
#include "dtrain/blas.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm_hook.h"
#include "dtrain/communicator.h"
#include "dtrain/config.h"
#include "dtrain/data_parallel.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "dtrain/host_memory.h"
#include "dtrain/launcher.h"
#include "dtrain/rendezvous.h"
#include "dtrain/single_device.h"
#include "dtrain/store.h"
#include "dtrain/strategy.h"
#include "dtrain/work.h"
