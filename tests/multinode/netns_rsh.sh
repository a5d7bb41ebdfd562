#!/bin/sh
# mpirun's remote shell (--mca plm_rsh_agent) for "hosts" that are network namespaces on this
# machine: instead of ssh HOST CMD..., runs CMD in HOST's namespace, with a host name of its own
# (the namespace's, in a UTS namespace): Open MPI names its shared-memory segments and session
# directories after the host name, and two "hosts" sharing one would share those files.
# NETNS_RSH_HOSTS maps hosts to namespaces ("10.214.0.2=dtb other=nsc"); mpirun passes its
# environment here.
host="$1"
shift
for pair in $NETNS_RSH_HOSTS; do
  if [ "${pair%%=*}" = "$host" ]; then
    # shellcheck disable=SC2016 # expanded by the inner sh
    exec ip netns exec "${pair#*=}" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' \
      "${pair#*=}" "$*"
  fi
done
echo "netns_rsh.sh: no namespace for host '$host' in NETNS_RSH_HOSTS='$NETNS_RSH_HOSTS'" >&2
exit 255
