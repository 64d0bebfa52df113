"""What to do about an error, said to a Python caller and to a command-line user.

:class:`Remedy` is one fix; :func:`sentence` joins a list of them into the words an error
ends with. :mod:`ckpt_tools.errors` re-exports :class:`Remedy`, where callers import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Remedy", "assignment", "sentence"]


@dataclass(frozen=True)
class Remedy:
    """One way to fix an error, said to a Python caller and to a command-line user.

    A remedy is an argument (``argument`` and ``value`` for Python, ``flag`` for the
    command line), or a command to run (the same for both), or words alone. ``text``
    follows the fix and says what it does, or is the whole fix when there is nothing to
    pass or run. A fix that only one audience can apply leaves the other side None, and
    that audience is not told about it.

    Attributes:
        argument: the Python keyword argument that fixes it (``"force"``).
        value: its value as Python source (``"True"``, ``"'a.b'"``); None when the verb
            says it all (``lower world_size``).
        flag: the command-line spelling of the same fix (``"--force"``, ``"--select a.b"``).
        command: a command to run instead (``"git lfs pull"``), shown to both.
        text: the words after the fix (``"to replace it"``), or the whole fix
            (``"choose another output path"``).
        verb: how the argument or flag is applied (``"pass"``, ``"lower"``, ``"leave out"``).

    Example:
        >>> fix = Remedy("force", "True", flag="--force", text="to replace it")
        >>> fix.render(), fix.render(for_cli=True)
        ('pass force=True to replace it', 'pass --force to replace it')
    """

    argument: str | None = None
    value: str | None = None
    flag: str | None = None
    command: str | None = None
    text: str = ""
    verb: str = "pass"

    def render(self, *, for_cli: bool = False) -> str | None:
        """This fix in words, for a Python caller or (``for_cli``) a command-line user.

        Args:
            for_cli: name the flag instead of the Python argument.

        Returns:
            The phrase, or None when this audience cannot apply the fix (a Python-only
            argument on the command line, a flag that has no Python argument).

        Example:
            >>> Remedy(command="git lfs pull", text="to fetch the real file").render()
            'run `git lfs pull` to fetch the real file'
        """
        if self.argument is not None or self.flag is not None:
            if for_cli:
                if self.flag is None:
                    return None
                fix = f"{self.verb} {self.flag}"
            else:
                if self.argument is None:
                    return None
                fix = f"{self.verb} {assignment(self.argument, self.value)}"
        elif self.command is not None:
            fix = f"run `{self.command}`"
        else:
            fix = ""
        return " ".join(part for part in (fix, self.text) if part)


def assignment(argument: str, value: str | None) -> str:
    """An argument as Python source: ``name=value``, or the bare name when there is no value.

    Example:
        >>> assignment("force", "True"), assignment("world_size", None)
        ('force=True', 'world_size')
    """
    return argument if value is None else f"{argument}={value}"


def sentence(remedies: Sequence[Remedy], for_cli: bool) -> str:
    """The one place remedies become words: ``A``, ``A, or B``, ``A, B, or C``.

    Args:
        remedies: the fixes, in the order to suggest them.
        for_cli: name flags instead of Python arguments; fixes this audience cannot apply
            are left out.

    Returns:
        The fixes joined into one phrase, or ``""`` when there is none to say.

    Example:
        >>> fixes = [Remedy("force", "True", flag="--force"), Remedy(text="choose another path")]
        >>> sentence(fixes, for_cli=True)
        'pass --force, or choose another path'
    """
    phrases = [p for p in (r.render(for_cli=for_cli) for r in remedies) if p]
    if len(phrases) < 2:
        return "".join(phrases)
    return ", ".join(phrases[:-1]) + ", or " + phrases[-1]
