"""`yeto-patch doctor` in the launcher environment recognises ms-swift and Megatron-Bridge and names the hooks that
attach for each (the survey imports Bridge's training modules; ms-swift's needs Transformer Engine or the
test-only shim, so its hooks are listed unsurveyed here)."""
import re

from tests.launchers import need
from tests.hooks.test_doctor import doctor

pytestmark = need("swift", "megatron.bridge")


def test_doctor_recognises_the_launchers_and_their_hooks():
    p = doctor("--no-handshake", "--no-import", env_extra={"YETO_DILOCO_SYNCER": "127.0.0.1:7640",
                                                           "YETO_DILOCO_INSECURE": "1"})
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    section = out[out.index("launchers (recognised here"):]
    assert re.search(r"ms-swift\s+recognised: ms-swift 4\.6\.\d", section), section
    assert re.search(r"Megatron-Bridge\s+recognised: megatron-bridge 0\.6\.\d", section), section
    assert re.search(r"Megatron-LM\s+recognised: megatron-core 0\.19\.\d", section), section
    for hook in ("swift_megatron", "bridge_train", "bridge_checkpointing", "mlm_training", "mcore_optimizer"):
        assert hook in section, (hook, section)
    # the writers each launcher opens, where the island's yeto/* figures go (tensorboard is installed here)
    assert re.search(r"writer TensorBoard\s+TensorboardCallback\.writer, with --report_to tensorboard "
                     r"\(default\); tensorboard installed", section), section
    assert re.search(r"writer TensorBoard\s+GlobalState\.tensorboard_logger, with cfg\.logger\.tensorboard_dir; "
                     r"tensorboard installed", section), section
    assert re.search(r"writer W&B\s+get_wandb_writer\(\), with --wandb-project; wandb not installed here",
                     section), section
