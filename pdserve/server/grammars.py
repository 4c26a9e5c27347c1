"""The front end's side of structured outputs: a request's constraint checked before it
is queued, off the event loop and within a time limit.

Every grammar a request brings (its response_format / structured_outputs / guided_*
constraint, each tool's `parameters` schema, the tool-call grammar tool_choice demands)
is compiled here once for this model (`GrammarChecker`: verdicts cached by grammar
text), in a small thread pool (llguidance drops the GIL while it compiles). One that
does not compile, or does not within `GrammarConfig.timeout_s`, is a 400 naming its field;
nothing is queued. llguidance's own limits (`grammar.compiler.LIMITS`) bound the work a
compile can do, so a timed-out compile still ends, in its thread.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pdserve.errors import InvalidRequestError
from pdserve.grammar.compiler import GrammarChecker, ll_tokenizer
from pdserve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class GrammarConfig:
    """`ServerConfig.grammars`."""

    # A grammar that takes longer to compile is refused (400); `serve --grammar-timeout`.
    timeout_s: float = 10.0
    threads: int = 2

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")


class Grammars:
    """Owns the pool; `close` it when the server stops."""

    def __init__(self, tokenizer: Tokenizer, config: GrammarConfig) -> None:
        self.config = config
        self._checker = GrammarChecker(lambda: ll_tokenizer(tokenizer.backend, None))
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="pdserve-grammars")

    def warm(self) -> None:
        """Start building llguidance's tokenizer (~1 s) so no request waits for it."""
        self._pool.submit(self._checker.warm)

    async def check(self, grammar: str, param: str) -> None:
        """InvalidRequestError naming `param` unless `grammar` compiles in time."""
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self._pool, self._checker.check, grammar, param)
        try:
            await asyncio.wait_for(job, self.config.timeout_s)
        except TimeoutError:
            raise InvalidRequestError(
                f"{param} took longer than {self.config.timeout_s:g} s to compile (the "
                "server's --grammar-timeout); send a smaller schema or grammar",
                param,
            ) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
