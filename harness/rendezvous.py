"""run.sh's wait for the other nodes: `python -c 'import harness.rendezvous; ...'`, beside torchrun on each node of
several, says how many nodes have joined torchrun's rendezvous until they all have. It imports torch.distributed and
nothing of the project: it starts in half the time of a module that imports torchvision (BENCHMARKS.md). It starts
with torchrun, on the same cores."""
import pickle
import time
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend


def watch_rendezvous(endpoint, run_id, nodes, timeout_s, first_s=5.0, every_s=60.0):
    """Until the nodes have met at torchrun's c10d rendezvous, say after first_s seconds and then every every_s how
    many have joined, where, and when torchrun gives up (--rdzv-conf join_timeout). Reads the rendezvous state from
    its store with torchrun's own backend class."""
    host, port = endpoint.rsplit(":", 1)
    started = time.time()
    gives_up = time.strftime("%H:%M:%S", time.localtime(started + float(timeout_s)))
    say_at, store = started + first_s, None
    while time.time() < started + float(timeout_s) + 60:
        joined = None
        try:
            if store is None:
                store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5),
                                 wait_for_workers=False)
            found = C10dRendezvousBackend(store, run_id).get_state()
            if found is not None:
                state = pickle.loads(found[0])
                if state.complete:
                    return  # the nodes have met: torchrun starts the workers
                joined = len(state.participants)
        except Exception:  # the host node's torchrun is not there yet (or has gone): try again
            store = None
        if time.time() >= say_at:
            count = (f"{joined} of {nodes} node(s) have joined" if joined is not None else
                     f"no answer from {endpoint} yet (the node with NODE_RANK=0 hosts it)")
            print(f"run.sh: waiting {time.time() - started:.0f} s for {nodes} nodes to meet at {endpoint} "
                  f"(rendezvous {run_id}): {count}; torchrun gives up at {gives_up} (JOIN_TIMEOUT={timeout_s} s)",
                  flush=True)
            say_at += every_s
        time.sleep(1.0)
