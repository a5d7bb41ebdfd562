/* Open MPI's own all-reduce, the baseline of benchmarks/bench-mpi.sh: MPI_Allreduce and
 * MPI_Iallreduce + MPI_Wait of one fp32 buffer, in place, on MPI_COMM_WORLD, timed as
 * dtrain_bench_collectives times its calls (back to back after a barrier, rank 0's mean).
 *   mpicc -O2 -o mpi_allreduce mpi_allreduce.c && mpirun -np 2 mpi_allreduce BYTES ITERS
 * Prints "MPI_Allreduce <bytes> <mean_us> <busbw_GBps>" and the same for MPI_Iallreduce. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const long bytes = argc > 1 ? atol(argv[1]) : 64L << 20;
  const int iters = argc > 2 ? atoi(argv[2]) : 4;
  const long n = bytes / 4;
  float* a = malloc((size_t)n * sizeof(float));
  for (long i = 0; i < n; ++i) a[i] = (float)(i % 13 + 1);
  for (int nonblocking = 0; nonblocking < 2; ++nonblocking) {
    /* One call first, untimed, as the benchmark verifies each size before timing it. */
    MPI_Allreduce(MPI_IN_PLACE, a, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    for (int it = 0; it < iters; ++it) {
      if (nonblocking) {
        MPI_Request request;
        MPI_Iallreduce(MPI_IN_PLACE, a, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &request);
        MPI_Wait(&request, MPI_STATUS_IGNORE);
      } else {
        MPI_Allreduce(MPI_IN_PLACE, a, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      }
    }
    const double mean = (MPI_Wtime() - start) / iters;
    if (rank == 0) {
      printf("%s %ld %.1f %.3f\n", nonblocking ? "MPI_Iallreduce" : "MPI_Allreduce", bytes,
             mean * 1e6, 2.0 * (world - 1) / world * (double)bytes / mean / 1e9);
    }
  }
  free(a);
  MPI_Finalize();
  return 0;
}
