"""The Mooncake master of a run: `python -m services.kvstore.master --config RUN_DIR/config.json`.

Started by the launcher when kvstore.mooncake.enabled (under a supervisor, like every service);
it replaces itself with `mooncake_master` on the configured ports (exec: SIGTERM reaches the master
directly). Its HTTP metadata server is what the gateways' store clients handshake through.
"""

from __future__ import annotations

import os
import sys

from services.common.config import ConfigError
from services.common.service import load_service_config, service_args
from services.kvstore.mooncake import MooncakeUnavailable, master_argv


def main() -> None:
    args = service_args("relay: the Mooncake master behind the KV store gateways")
    try:
        cfg = load_service_config(args)
        argv = master_argv(cfg.kvstore.mooncake)
    except (ConfigError, MooncakeUnavailable) as e:
        sys.exit(f"mooncake master: {e}")
    if not cfg.kvstore.mooncake.rpc_port or not cfg.kvstore.mooncake.metadata_port:
        sys.exit("mooncake master: kvstore.mooncake.rpc_port and metadata_port must be set")
    print(f"exec {' '.join(argv)}", file=sys.stderr, flush=True)
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
