"""The mistakes a user can fix: raised anywhere in the harness, said in one line (`main.py: error: ...`) by
recovery.guard. Low in the imports (only images.py, whose BadInput it names too), so that every module can raise them.

    errors.fail("--lr nan must be above 0")                  # every rank finds it alike: rank 0 says it
    errors.fail("GPU 3 not visible", this_rank=True)          # only this rank meets it: this rank says it
    errors.first_line(error)                                  # an error's own first line, whole

A damaged file of the data set is BadInput: the data's own error, defined in images.py so that dataset.py raises it
without the harness. A backbone file that cannot be used is models.WeightsError, for the same reason.
"""
from images import BadInput, first_line  # noqa: F401 (the harness's error types and helper, from one place)


class UserError(Exception):
    """A mistake the user can fix. this_rank=False: every rank finds it the same way (a flag, a folder, a checkpoint),
    and rank 0 says it; True: only this rank meets it (its GPU, a write that failed), and this rank says it."""

    def __init__(self, message, this_rank=False):
        super().__init__(message)
        self.this_rank = this_rank


def fail(message, this_rank=False):
    raise UserError(str(message), this_rank)


# --check-only's exit status when the run it would resume has finished: run.sh then starts no torchrun on one node.
NOTHING_TO_TRAIN = 3


class Finished(Exception):
    """Not a mistake: the run has done all it will (--check-only after its checks, a stop after its save).
    recovery.guard ends the program there with exit status `status` (0, or NOTHING_TO_TRAIN), after letting go of
    what the run holds."""

    def __init__(self, status=0):
        super().__init__(status)
        self.status = status
