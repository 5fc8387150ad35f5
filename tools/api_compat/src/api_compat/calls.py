"""Call expressions of griffe's static analysis, bound to the parameters of the called function."""

from collections.abc import Sequence
from typing import Any

import griffe

_UNPACKED = (griffe.ExprVarPositional, griffe.ExprVarKeyword)


def bind_arguments(call: griffe.ExprCall, positional: Sequence[str]) -> dict[str, Any] | None:
    """The call's arguments by parameter name, given the callee's positional parameters in order.

    None where ``*args``, ``**kwargs`` or surplus positional arguments make the binding unknowable.
    """
    bound: dict[str, Any] = {}
    for index, argument in enumerate(call.arguments):
        if isinstance(argument, griffe.ExprKeyword):
            bound[argument.name] = argument.value
        elif index < len(positional) and not isinstance(argument, _UNPACKED):
            bound[positional[index]] = argument
        else:
            return None
    return bound
