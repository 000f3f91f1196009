"""The warnings the engine gives once, worded in one place."""

GRAD_SCALER_WARNING = (
    "overlapckpt: GradScaler drives this optimizer's fused step (it sets optimizer.grad_scale and "
    "found_inf): the step unscales gradients and skips infinite ones inside the kernel, which replay "
    "cannot follow. Checkpoints that would replay use window=1 instead (exact at the requested step), "
    "and a replay window open now restarts at window 1; use consistency='stage' to spread the copy "
    "over a window."
)

NEW_STATE_WARNING = (
    "overlapckpt: the optimizer gained state or parameters inside the replay window of the checkpoint "
    "requested at step {old} (a parameter unfrozen, or add_param_group), which that snapshot's layout "
    "lacks, so it was restarted at step {new}."
)

BOUNDARY_WARNING = (
    "overlapckpt: ckpt.step() was not called after the optimizer step that a checkpoint holds, so "
    "stateful objects (LR schedulers, samplers) and RNG states were captured in the optimizer's "
    "post-step hook, before the rest of the iteration ran (e.g. before scheduler.step()). A resumed "
    "run then repeats that part of the iteration. Call ckpt.step() at the end of each iteration, "
    "after scheduler.step()."
)

LATE_HOOK_WARNING = (
    "overlapckpt: {count} optimizer post-step hook(s) run after overlapckpt's (registered after the "
    "Checkpointer, or global). Between overlapckpt's post-hook and the next optimizer step, nothing may "
    "write parameters, buffers or optimizer state in place (an EMA update into model tensors, "
    "p.data.clamp_()): the checkpoint copies them in that interval. Register such hooks before creating "
    "the Checkpointer, or do the write before optimizer.step() returns."
)

WRITER_RESTART_WARNING = (
    "overlapckpt: the writer process died ({error}); a new one was started and given the host buffers. "
    "Checkpoints complete in host memory are persisted by it; one still being copied was dropped (see "
    "ckpt.snapshots_dropped). At most {limit} restarts an hour are made; the next death is raised. In a "
    "distributed run the new writer re-forms the writers' group with the others, and the checkpoint in flight "
    "is lost on every rank (never listed); the next one commits."
)

CLOSURE_IGNORED_WARNING = (
    "overlapckpt: {optimizer}.step() takes a closure but did not call the one overlapckpt passed it, so its "
    "update ran before overlapckpt's fences. The checkpoints in flight were restarted at the next step, and "
    "the fences now run in the step pre-hook (exact; with a closure, the copy no longer overlaps forward "
    "and backward)."
)

REPLAY_MUTATION_WARNING = (
    "overlapckpt: parameters or optimizer state that a replay window had copied were written in place before "
    "the optimizer's update, by a step pre-hook or the closure ({hooks}). Replay repeats only the optimizer's "
    "update rule, so checkpoints that would replay use window=1 from now on (exact at the requested step), "
    "and the open window restarts. Use consistency='stage' to spread the copy over a window."
)

ROOT_AHEAD_WARNING = (
    "overlapckpt: this run's checkpoint of version {version} goes to {root}, which holds another run's checkpoints "
    "up to version {newest} (the newest: {versions}): its names read as if training had started over. To continue "
    "that run, restore it first (load(root, model, optimizer) before building the Checkpointer, or ckpt.restore()), "
    "or say which version this state is: ckpt.continued_from(<version>)"
)
