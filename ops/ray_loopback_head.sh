#!/bin/sh
# A Ray head whose every process listens on 127.0.0.1 only, with Ray's token authentication on:
# the one-machine cluster slidespec runs on. Options after the script's name go to `ray start`:
#
#   ray get-auth-token --generate          # once: the cluster token, in ~/.ray/auth_token
#   ops/ray_loopback_head.sh --num-cpus 8
#   export RAY_AUTH_MODE=token             # Ray's CLI sends the token
#   serve deploy ops/serve.yaml            # serve status, serve shutdown -y, ray stop as usual
#
# Ray 2.60 binds its GCS, raylet, object manager, workers, agents and client server to loopback
# when the node's IP is 127.0.0.1, and to every interface (or the machine's address) otherwise.
# `ray start` replaces a loopback --node-ip-address with the machine's address unless
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which is why it is set here; with it no other machine can
# join this head (a multi-node cluster uses the machines' addresses and a firewall instead).
# A Ray client that connects by the GCS address (`serve run`, `ray status`, `ray.init(address=...)`)
# needs it too, or it replaces 127.0.0.1 the same way and waits for a GCS that is not there;
# `serve deploy`, `serve status` and `serve shutdown` talk to the dashboard and need only the token.
set -eu
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
exec ray start --head --node-ip-address 127.0.0.1 --dashboard-host 127.0.0.1 "$@"
