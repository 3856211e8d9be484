"""The Python kernel: ipykernel configured the way E2B's template configures it.

Run as a script by the server (``python3 pykernel.py -f CONNECTION_FILE``). Settings:
tracebacks without ANSI colours (``NoColor``), no history database, sequences printed in
full, the inline matplotlib backend (figures come back as ``image/png`` display data), and
two extra formatters: ``e2b/data`` (a pandas DataFrame as ``{column: [values]}``) and
``e2b/chart`` (a matplotlib figure's data, see ``charts.py``). Nothing is added to the
user's namespace.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
# Running as a script put this directory first on sys.path: the user's `import server`
# must not find the code interpreter's own modules.
if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _HERE:
    del sys.path[0]

STARTUP_MODULE = "_dsec_codeinterp_startup"


def _load_charts() -> Any:
    spec = importlib.util.spec_from_file_location(
        "_dsec_codeinterp_charts", os.path.join(_HERE, "charts.py")
    )
    if spec is None or spec.loader is None:
        raise ImportError("charts.py not found")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install(ip: Any) -> None:
    """Register the ``e2b/data`` and ``e2b/chart`` formatters on the shell ``ip``."""
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class DataFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict, str)

        def __call__(self, obj: Any) -> Any:
            pandas = sys.modules.get("pandas")  # a DataFrame exists only if pandas was imported
            if pandas is None or not isinstance(obj, pandas.DataFrame):
                return super().__call__(obj)
            out = obj.to_dict(orient="list")
            for key, values in out.items():
                out[key] = [v.isoformat() if isinstance(v, pandas.Timestamp) else v for v in values]
            return out

    class ChartFormatter(BaseFormatter):
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict, str)
        _charts: Any = None

        def __call__(self, obj: Any) -> Any:
            if sys.modules.get("matplotlib") is None:
                return super().__call__(obj)
            from matplotlib.figure import Figure

            if not isinstance(obj, Figure):
                return super().__call__(obj)
            try:
                if ChartFormatter._charts is None:
                    ChartFormatter._charts = _load_charts()
                return ChartFormatter._charts.figure_to_chart(obj)
            except Exception:  # a figure we cannot read is still shown as a PNG
                return None

    formatters = ip.display_formatter.formatters
    formatters["e2b/data"] = DataFormatter(parent=ip.display_formatter)
    formatters["e2b/chart"] = ChartFormatter(parent=ip.display_formatter)


def main() -> None:
    from ipykernel.kernelapp import IPKernelApp
    from traitlets.config import Config

    startup = types.ModuleType(STARTUP_MODULE)
    startup.install = install  # type: ignore[attr-defined]
    sys.modules[STARTUP_MODULE] = startup
    c = Config()
    c.InteractiveShell.colors = "NoColor"
    c.InteractiveShell.xmode = "Context"
    c.HistoryManager.enabled = False
    c.PlainTextFormatter.max_seq_length = 0
    c.IPKernelApp.exec_lines = [f"__import__({STARTUP_MODULE!r}).install(get_ipython())"]
    IPKernelApp.launch_instance(config=c)


if __name__ == "__main__":
    main()
