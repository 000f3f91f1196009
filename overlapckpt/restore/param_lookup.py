"""Constant-time "is this parameter in this group" for torch's optimizer loading, which asks it once per state value.

``Optimizer.load_state_dict`` decides each state tensor's cast by scanning every saved
group's ``params`` list for the tensor's parameter id (``param_id in pg["params"]``), and
DCP's ``_split_optim_state_dict`` scans the loaded groups' lists for each parameter's name
the same way. Both are a list scan per value: quadratic in the parameters, 3.4 s and 1 s
of a 30,000-tensor load (``benchmarks/results/many-tensors-direct``). The groups handed to
them here hold their ``params`` in :class:`ParamList`, a list whose ``in`` is a set lookup.
Everything else about the list (order, length, equality, iteration, deepcopy) is a list's,
so what torch reads from the groups is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch


class ParamList(list):
    """A list of parameter ids or names whose ``in`` is a set lookup, rebuilt when the list changes.

    For hashable items compared by value (torch hands it ints and names): a tensor would be
    found by identity here, where a list compares values.
    """

    def __init__(self, items: Iterable[Any] = ()) -> None:
        super().__init__(items)
        self._members: set[Any] | None = None
        self._members_len = -1

    def __contains__(self, item: object) -> bool:
        members = self._lookup()
        if members is None:
            return super().__contains__(item)
        try:
            return item in members
        except TypeError:  # an unhashable probe: the list's own scan answers it
            return super().__contains__(item)

    def _lookup(self) -> set[Any] | None:
        # The set is taken again after any in-place change (the mutators below drop it) and
        # whenever the length moved (a change through a path no mutator covers, as *=).
        if self._members_len != len(self):
            try:
                self._members = set(self)
            except TypeError:  # unhashable items (not an id or a name): scan as a list does
                self._members = None
            self._members_len = len(self)
        return self._members

    def _changed(self) -> None:
        self._members_len = -1

    # Every way a list changes in place drops the set, so that a change that keeps the
    # length (an append, then a pop) is never answered from the old members.
    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        self._changed()

    def __delitem__(self, index: Any) -> None:
        super().__delitem__(index)
        self._changed()

    def __iadd__(self, items: Any) -> ParamList:  # type: ignore[misc]
        super().__iadd__(items)
        self._changed()
        return self

    def append(self, item: Any) -> None:
        super().append(item)
        self._changed()

    def extend(self, items: Any) -> None:
        super().extend(items)
        self._changed()

    def insert(self, index: Any, item: Any) -> None:
        super().insert(index, item)
        self._changed()

    def pop(self, index: Any = -1) -> Any:
        item = super().pop(index)
        self._changed()
        return item

    def remove(self, item: Any) -> None:
        super().remove(item)
        self._changed()

    def clear(self) -> None:
        super().clear()
        self._changed()


def with_param_lists(groups: Any) -> Any:
    """``groups`` (a state dict's ``param_groups``) with each group a shallow copy whose ``params`` is a :class:`ParamList`.

    Anything not shaped as a list of dicts with a list of ``params`` is answered as it is.
    """
    if not isinstance(groups, list):
        return groups
    out = []
    for group in groups:
        if isinstance(group, dict) and isinstance(group.get("params"), list) and not isinstance(group["params"], ParamList):
            group = {**group, "params": ParamList(group["params"])}
        out.append(group)
    return out


def optimizer_state_with_param_lists(optim_sd: Any) -> Any:
    """An optimizer state dict (``{"state", "param_groups"}``) whose groups hold :class:`ParamList`; others as they are."""
    if not isinstance(optim_sd, dict) or "param_groups" not in optim_sd:
        return optim_sd
    return {**optim_sd, "param_groups": with_param_lists(optim_sd["param_groups"])}


@contextlib.contextmanager
def param_lists_while_loading(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[None]:
    """While open, each optimizer's ``load_state_dict`` sees the groups it loads with :class:`ParamList` params.

    A load-state-dict pre-hook, registered after the user's own (so theirs see the state
    dict as it came), and removed on the way out whatever happened.
    """

    def hook(_optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        return optimizer_state_with_param_lists(state_dict)

    handles = []
    try:
        for optimizer in optimizers:
            handles.append(optimizer.register_load_state_dict_pre_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()
