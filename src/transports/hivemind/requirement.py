"""hivemind is an optional dependency: importing it, or saying how to install it when it is missing."""

from types import ModuleType

INSTALL_HINT = "the hivemind transport needs hivemind: pip install diloco[hivemind]"


def import_hivemind() -> ModuleType:
    """hivemind itself, or an ``ImportError`` that says how to install it."""
    try:
        import hivemind
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    from .process_locks import install

    install()  # before any hivemind process starts: no lock a killed process can leave held
    return hivemind
