"""TEST-ONLY fixes for running ms-swift 4.6.0's `megatron sft` (mcore-bridge 1.6.5) on CPU without Transformer
Engine; each was added because the run failed without it. Applied by tests/launchers/site/sitecustomize.py when
swift's model registry is imported (nothing is passed to ms-swift on its command line)."""
import os


def apply():
    import mcore_bridge.model.register as R
    from mcore_bridge.bridge import gpt_bridge as GB
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if getattr(R.ModelLoader, "_yeto_test_cpu", False):
        return
    R.ModelLoader._yeto_test_cpu = True

    # P1 ModelLoader.get_transformer_layer_spec hard-codes use_transformer_engine=True (TE layers): build the
    #    local (torch) spec instead.
    def get_transformer_layer_spec(self, vp_stage=None):
        with self._patch_experimental_attention_variant():
            spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False,
                                              normalization=self.config.normalization,
                                              qk_l2_norm=self.config.qk_l2_norm, vp_stage=vp_stage)
            self._deepcopy_layer_spec(spec)
        return spec
    R.ModelLoader.get_transformer_layer_spec = get_transformer_layer_spec

    # P2 the HF<->mcore weight mapping assumes TE's fused LayerNorm+Linear (the norm weight lives at
    #    linear_qkv.layer_norm_weight / linear_fc1.layer_norm_weight); the local spec keeps separate
    #    input_layernorm / pre_mlp_layernorm modules: map those two names (load and save both go through here).
    local_norms = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                   "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
    orig = GB.GPTBridge._set_state_dict

    def _set_state_dict(self, mg_module, mg_key, hf_state_dict, hf_key, to_mcore, **kw):
        alt = local_norms.get(mg_key)
        if alt is not None and mg_module is not None and getattr(
                getattr(mg_module, alt.split(".")[0], None), "weight", None) is not None:
            mg_key = alt
        return orig(self, mg_module, mg_key, hf_state_dict, hf_key, to_mcore, **kw)
    GB.GPTBridge._set_state_dict = _set_state_dict
    if os.environ.get("RANK", "0") == "0":
        print("[swift_cpu_fixes] local layer spec and norm-name mapping installed", flush=True)
