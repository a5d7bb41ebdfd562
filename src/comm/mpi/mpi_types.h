// How dtrain's tensors and reductions map onto MPI: datatypes, predefined reductions, and the
// reductions MPI lacks (float16 and bfloat16 have no MPI datatype: they travel as 16-bit
// words and are reduced by user-defined operations, in float).
#pragma once

#include <c10/core/ScalarType.h>
#include <mpi.h>

#include <string>

#include "dtrain/communicator.h"

namespace dtrain::mpi_backend {

// The MPI datatype of one element of `dtype` (float16/bfloat16: MPI_UINT16_T), for the dtypes
// every CPU transport moves (reduce::is_supported_dtype); MPI_DATATYPE_NULL for others.
MPI_Datatype datatype(c10::ScalarType dtype);

// MPI's error string for `code`: "MPI_ERR_TRUNCATE: message truncated".
std::string error_string(int code);

// The reductions of one MPI library, created once MPI is initialized and freed before it is
// finalized: the predefined ones, plus sum/min/max on float16 and bfloat16. kAvg is a sum here
// (the engine divides afterwards).
class Reductions {
 public:
  Reductions();  // MPI must be initialized
  ~Reductions();
  Reductions(const Reductions&) = delete;
  Reductions& operator=(const Reductions&) = delete;

  MPI_Op op(c10::ScalarType dtype, ReduceOp reduce) const;

 private:
  MPI_Op half_[3];  // sum, min, max on float16
  MPI_Op bf16_[3];  // on bfloat16
};

}  // namespace dtrain::mpi_backend
