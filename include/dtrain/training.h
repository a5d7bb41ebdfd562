// The training utilities: what a training step uses around a strategy, each working under
// every strategy.
//
//   autocast.h               Autocast: mixed precision of the forward (bf16, fp16)
//   grad_scaler.h            GradScaler: loss scaling for fp16, the same skipped steps everywhere
//   fused_adamw.h            FusedAdamW: AdamW updating each parameter in one pass
//   activation_checkpoint.h  checkpoint(): recompute a block's activations in backward
//   sync_batch_norm.h        SyncBatchNorm: batch statistics of the global batch
//   attention.h              scaled dot-product attention on every LibTorch dtrain supports
//   blas.h                   the BLAS kernel a process runs; whether the CPU has native bf16
//   host_memory.h            malloc tuning so that freed host memory goes back to the system
#pragma once

#include "dtrain/activation_checkpoint.h"
#include "dtrain/attention.h"
#include "dtrain/autocast.h"
#include "dtrain/blas.h"
#include "dtrain/fused_adamw.h"
#include "dtrain/grad_scaler.h"
#include "dtrain/host_memory.h"
#include "dtrain/sync_batch_norm.h"
