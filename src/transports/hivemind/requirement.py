"""hivemind is an optional dependency: importing it, or saying how to install it when it is missing."""

from types import ModuleType

INSTALL_HINT = (
    "the hivemind transport needs hivemind, which is not installed: pip install 'diloco[hivemind]'"
)


class HivemindMissing(ImportError, ValueError):
    """hivemind is not installed: an ``ImportError`` for the library's users, and a ``ValueError`` (a setting
    this machine cannot run) for the trainer, which ends with the hint in one line and exit status 2."""


def import_hivemind() -> ModuleType:
    """hivemind itself, or a ``HivemindMissing`` that says how to install it."""
    try:
        import hivemind
    except ImportError as e:
        raise HivemindMissing(INSTALL_HINT) from e
    from .process_locks import install

    install()  # before any hivemind process starts: no lock a killed process can leave held
    return hivemind
