"""The benchmark's WAL-reading relay (`handoff-bench --only mq-bridge`, docs/benchmarks.md).

mq-bridge (https://github.com/marcomq/mq-bridge) reads a Postgres publication through a logical
replication slot the bench created before it recorded the backlog, and publishes every captured row
to a JetStream stream the bench created, with a message id per row (`deduplicate`), acknowledging
the slot only after the broker's PubAck. It runs until SIGTERM. Everything comes from the
environment the bench sets:

  MQB_DATABASE_URL  MQB_PUBLICATION  MQB_SLOT  MQB_NATS_URL  MQB_STREAM  MQB_SUBJECT  MQB_BATCH_SIZE
"""

import os
import signal
import threading

from mq_bridge import Route

env = os.environ
ROUTE = {
    "routes": {
        "wal": {
            "input": {
                "postgres_cdc": {
                    "url": env["MQB_DATABASE_URL"],
                    "publication": env["MQB_PUBLICATION"],
                    "slot_name": env["MQB_SLOT"],
                    "create_slot": False,
                    "create_publication": False,
                    "consume": "capture_new",
                }
            },
            "output": {
                "nats": {
                    "url": env["MQB_NATS_URL"],
                    "stream": env["MQB_STREAM"],
                    "subject": env["MQB_SUBJECT"],
                    "deduplicate": True,
                }
            },
            "batch_size": int(env["MQB_BATCH_SIZE"]),
        }
    }
}

stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
route = Route.from_config(ROUTE, "wal")
route.start()
while not stop.wait(0.5):
    pass
route.stop()
route.join()
