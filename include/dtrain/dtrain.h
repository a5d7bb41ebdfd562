// Umbrella header: everything a training program needs from dtrain.
#pragma once

#include "dtrain/communicator.h"
#include "dtrain/config.h"
#include "dtrain/errors.h"
#include "dtrain/rendezvous.h"
#include "dtrain/store.h"
#include "dtrain/work.h"
