"""The V placement computes the loss on pipeline rank 0, and the Megatron backend hands the loss dicts to the last
rank, where Megatron's training loop reads them (``last_stage.hand_to_last_rank``). A dict holding what cannot be
pickled (a lambda; Megatron's own schedules never send the dicts) was a pickling traceback on rank 0 and, on the
last rank, a wait until the process group's timeout (on gloo, "Connection closed by peer" once rank 0 exited).
Both ranks now refuse in one line naming the two ranks. Two gloo ranks, a few seconds."""

import torch

from hostile_support import Outcome, refused, run_api
from primuspipe.testing.gloo import run_gloo


def _hand_over(rank: int, world: int):
    """Rank 0 holds the V's loss dicts; one of them holds a lambda. Each rank's outcome, classified."""
    import torch.distributed as dist

    from primuspipe.backends.megatron.last_stage import hand_to_last_rank

    store = [{"lm loss": torch.tensor([1.0, 2.0]), "reduce": lambda: 1}] if rank == 0 else []
    outcome = run_api(hand_to_last_rank, store, torch.zeros([], dtype=torch.int), src=0, rank=rank,
                      group=dist.group.WORLD, device=torch.device("cpu"))
    return outcome.kind, outcome.message


def test_a_loss_dict_the_v_cannot_send():
    for rank, (kind, message) in enumerate(run_gloo(_hand_over, 2, timeout_s=60)):
        refused(Outcome(kind, 1, message), "loss function", "rank 0", "rank 1",
                case=f"Megatron V loss dict holding a lambda, rank {rank}")
