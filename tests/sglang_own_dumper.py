"""SGLang's own ``_Dumper`` (its ``dumper.py`` from the PyPI wheel, path in ``TPCHECK_SGLANG_DUMPER``) behind
``tpcheck.engines.sglang_dump.writer``'s sink interface, for the fidelity test: its server-side imports (zmq, SGLang's
runtime) stubbed, its rank functions and framework plugin replaced so each rank's files carry that rank's
``sglang_parallel_info``, as inside an SGLang TP worker."""
import importlib.util
import sys
import types


def load(path):
    for name in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.managers.io_struct",
                 "sglang.srt.runtime_context", "sglang.srt.utils", "zmq"):
        sys.modules.setdefault(name, types.ModuleType(name))
    io = sys.modules["sglang.srt.managers.io_struct"]
    io.sock_recv = io.sock_send = io.wrap_as_pickle = None
    rc = sys.modules["sglang.srt.runtime_context"]
    rc.get_parallel = rc.get_server_args = rc.get_serving = None
    sys.modules["sglang.srt.utils"].get_device = lambda: "cpu"
    spec = importlib.util.spec_from_file_location("sglang_dumper", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sglang_dumper"] = mod
    spec.loader.exec_module(mod)
    return mod

class SGLangSink:
    def __init__(self, mod, out, tp, parallel_info):
        self.mod, self.tp = mod, tp
        self.rank = 0
        mod._get_rank = lambda: self.rank
        mod._get_world_size = lambda: tp
        sink = self
        class Plugin(mod._FrameworkPlugin):
            name = "sglang"
            def collect_parallel_info(self): return parallel_info(sink.rank, tp)
            def convert_value(self, value, *, skip_forward_batch): return None
            def detect_layer_id(self, module): return None
        mod._plugins[:] = [Plugin()]
        self.dumpers = []
        for r in range(tp):
            self.rank = r
            d = mod._Dumper(config=mod.DumperConfig(enable=True, dir=str(out), exp_name="sglang_exp",
                                                    enable_output_console=False))
            _ = d._static_meta  # computed now, for this rank
            self.dumpers.append(d)
    def dump(self, rank, name, value, dims, tags):
        self.rank = rank
        self.dumpers[rank].dump(name, value, dims=dims, **tags)
    def step(self, rank):
        self.rank = rank
        self.dumpers[rank].step()
