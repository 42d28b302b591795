"""What keeping the layout and the loader's place costs: the layout watch and the loader's bookkeeping against a
training step, in one run (what is timed: docs/benchmarks.md#whole-run-cost).

    python -m scripts.bench.whole_run_cost                     # ResNet-50, batch 8 at 224 px, 5 rounds
    python -m scripts.bench.whole_run_cost --model resnet18 --batch 4 --size 64 --rounds 3   # seconds
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchvision

from cltrain.data.prefetch import ResumableLoader
from cltrain.data.resume_state import ResumableSampler
from cltrain.data.running_stats import RunningStats
from cltrain.data.stream_place import Place, StreamPlaces, Tagged, row_seed
from cltrain.host import Host
from cltrain.session import LayoutSession
from scripts.harness import machine_line, options, table, time_steps, training_step


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = options(__doc__, model="resnet50", batch=8, size=224, rounds=5,
                   min_window=(0.05, "seconds of calls per figure and round")).parse_args(argv)
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    session = LayoutSession(layout="channels_last", host=Host(optimizers=lambda: [opt]))
    session.start(model)
    session.expect(model)
    x = torch.randn(args.batch, 3, args.size, args.size).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,))

    step = training_step(model, lambda: F.cross_entropy(model(x), y), optimizer=opt)

    def moved() -> None:
        for p in model.parameters():
            if p.dim() == 4:
                p.data = p.data.contiguous()
        session.boundary(model)

    loader = ResumableLoader(torch.utils.data.TensorDataset(torch.zeros(64, 1)), batch_size=8,
                             sampler=ResumableSampler(64, seed=0))
    places, tagged = StreamPlaces(), Tagged(0, {0: Place(row=7, copies=0, next=8)}, None)
    stats = RunningStats()
    cases = {  # name: (when it runs, the call)
        "step": ("every step", step),
        "boundary, nothing moved": ("each epoch's end and each validation", lambda: session.boundary(model)),
        "boundary, every weight moved": ("the same, after a hook moved them", moved),
        "note_taken": ("every step", loader.note_taken),
        "loader state_dict": ("each checkpoint", loader.state_dict),
        "BatchNorm statistics held": ("every step", lambda: stats.hold(model)),
        "stream: a sample's seed": ("every sample of a stream", lambda: row_seed(2**61, 3, 1, 12345, 0, 0)),
        "stream: a batch's place": ("every batch of a stream", lambda: places.fetched(tagged))}
    timing = time_steps({name: call for name, (_, call) in cases.items()},  # each figure from the same stretch
                        rounds=args.rounds, warmup=1, min_window=args.min_window, max_steps=100_000, size_each=True)
    figures = {name: s.median for name, s in timing.per_step().items()}
    print(f"{args.model}, batch {args.batch} at {args.size} px, channels_last, SGD; medians of {args.rounds} rounds\n")
    print(table(["what", "when", "ms", "of one step"],
                [[name, cases[name][0], f"{value * 1e3:.4g}", f"{value / figures['step']:.2g}"]
                 for name, value in figures.items()], align="llrr"))
    print(machine_line())
    return figures


if __name__ == "__main__":
    main()
