#!/bin/sh
# Runs a program under a real Open MPI mpirun, as root too (CI runs as root):
#   run.sh NP PROGRAM [ARGS...]
# Exit 77 (ctest: skipped) when there is no mpirun (openmpi-bin; scripts/install-deps.sh
# installs it with libopenmpi-dev). NP may exceed the cores (--oversubscribe); no binding, as
# the ranks share the cores.
np=$1
shift
command -v mpirun >/dev/null 2>&1 || { echo "skipped: no mpirun (Debian: openmpi-bin)"; exit 77; }
exec mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$np" "$@"
