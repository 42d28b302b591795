"""``python -m torch.distributed.run ARGS``, its workers forked by the tests' server (:mod:`tests.helpers.warm`)
when this process is one it forked: ``python -m tests.helpers.torchrun ARGS``."""

from torch.distributed.run import main

from tests.helpers import warm

if __name__ == "__main__":
    warm.torchrun_workers_forked()
    main()
