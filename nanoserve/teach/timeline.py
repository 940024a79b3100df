"""A request's life drawn as a timeline (Days 29-33): a row per request, a column per engine step,
each cell what that step did for it: waiting, a prompt chunk, a decode token, preempted. And a batch
run (`BatchTiming`) drawn in seconds: each row's own work, and the time its answer is held back.

`simulate` runs the scheduler alone, with no model (every sampled token is 0): the scheduler holds no
tensors, so a slider can replay a whole workload in milliseconds. Given prompts' token ids and
`prefix_caching=True` it replays prefix hits too: blocks are named after each step, as the engine does."""

from __future__ import annotations

from collections.abc import Sequence

from ..bench.batchbench import BatchTiming
from ..engine import Request, RequestStatus, Scheduler, SchedulerConfig
from ..kv import BlockManager
from ..sampling import SamplingParams

STATES = ("waiting", "prefill", "decode", "preempted")
COLORS = {"waiting": "#d9d9d9", "prefill": "#4c72b0", "decode": "#55a868", "preempted": "#c44e52"}

Scheduled = Sequence[tuple[str, int, int]]  # (request id, first token, tokens): one step's chunks


def states(steps: Sequence[Scheduled], requests: dict[str, Request]) -> dict[str, list[str]]:
    """Per request, per step: "" before it arrives and after it ends, else one of STATES."""
    out = {}
    for rid, req in requests.items():
        arrived = req.events[0][0]
        ended = next((s for s, st in req.events if st is RequestStatus.FINISHED), len(steps))
        row = []
        for s, chunks in enumerate(steps):
            mine = [(start, n) for r, start, n in chunks if r == rid]
            if mine:
                start, n = mine[0]
                row.append("decode" if n == 1 and start >= req.num_prompt_tokens else "prefill")
            elif arrived <= s < ended:
                last = [st for at, st in req.events if at <= s]
                row.append("preempted" if last and last[-1] is RequestStatus.PREEMPTED else "waiting")
            else:
                row.append("")
        out[rid] = row
    return out


def draw(ax, steps: Sequence[Scheduled], requests: dict[str, Request], title: str = "") -> None:
    """The timeline on a matplotlib axis: requests top to bottom in arrival order."""
    rows = states(steps, requests)
    for y, cells in enumerate(rows.values()):
        for x, cell in enumerate(cells):
            if cell:
                ax.barh(y, 1, left=x, color=COLORS[cell], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [f"request {rid}" for rid in rows])
    ax.invert_yaxis()
    ax.set_xlabel("engine step")
    ax.set_xlim(0, max(len(steps), 1))
    handles = [ax.barh(0, 0, color=COLORS[s], label=s) for s in STATES]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title)


def simulate(arrivals: Sequence[tuple[int, int | Sequence[int], int]], config: SchedulerConfig, num_blocks: int,
             block_size: int = 16, max_steps: int = 10_000,
             prefix_caching: bool = False) -> tuple[list[Scheduled], dict[str, Request]]:
    """Replay (arrival step, prompt, output tokens) requests through the scheduler alone. A prompt is a
    token count (distinct tokens: no two prompts share a block) or the prompt's token ids (so prompts can
    share a prefix, found with `prefix_caching`). Returns each step's chunks and the requests, for `draw`."""
    sched = Scheduler(BlockManager(num_blocks, block_size, prefix_caching=prefix_caching), config)
    requests: dict[str, Request] = {}
    steps: list[Scheduled] = []
    for s in range(max_steps):
        for i, (at, prompt, new) in enumerate(arrivals):
            if at == s:
                ids = [1000 * (i + 1) + j for j in range(prompt)] if isinstance(prompt, int) else list(prompt)
                req = Request(str(i), ids, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), new)
                requests[req.request_id] = req
                sched.add(req, s)
        if s > max(a for a, _, _ in arrivals) and not sched.has_unfinished():
            break
        plan = sched.schedule(s)
        steps.append([(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks])
        # the "forward" ran: every request whose chunk reached its end samples token 0, and the scheduler
        # does the engine's bookkeeping (tokens computed, full blocks named, finished requests out)
        sched.update_from_output(plan, {c.request: [0] for c in plan.chunks if c.completes}, float(s), s)
    return steps, requests


def prefill_tokens(steps: Sequence[Scheduled], requests: dict[str, Request]) -> list[int]:
    """Tokens each step computes that are not decode tokens (prompts, prompt chunks, recomputation): the
    work a prefix hit saves. The engine's `StepRecord.num_prefill_tokens`, from the chunks alone."""
    return [sum(n for rid, start, n in chunks if not (n == 1 and start >= requests[rid].num_prompt_tokens))
            for chunks in steps]


def draw_batch(ax, t: BatchTiming, title: str = "") -> None:
    """One bar per row: grey the prefill, blue the row's own decode steps, red hatching the time its finished
    answer is held back (a static batch hands every row back at the end; the engine each when done)."""
    for row, (done, back) in enumerate(zip(t.row_done_s, t.row_returned_s)):
        ax.barh(row, t.prefill_s, color="tab:gray")
        ax.barh(row, done - t.prefill_s, left=t.prefill_s, color="tab:blue")
        if back > done:
            ax.barh(row, back - done, left=done, color="none", edgecolor="tab:red", hatch="///", lw=0)
    ax.axvline(max(t.row_returned_s), ls="--", c="k")
    ax.set(xlabel="seconds", ylabel="row", title=title, yticks=range(t.batch_size))
    ax.invert_yaxis()
