// The checkpoints layer: the training state saved under any strategy and loaded under any
// other strategy and world size, and the file formats it is made of.
//
//   checkpoint.h   save_checkpoint, Checkpointer (background saves), load_checkpoint
//   safetensors.h  safetensors files: a memory-mapped reader of any range, a writer
//   crc32c.h       CRC-32C, the checksum of every checkpoint file
//   json.h         dtrain's JSON value (manifests, safetensors headers)
#pragma once

#include "dtrain/checkpoint.h"
#include "dtrain/crc32c.h"
#include "dtrain/json.h"
#include "dtrain/safetensors.h"
