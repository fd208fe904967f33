//! An independent float64 forward pass of llama/qwen2/qwen3/gemma2/gemma3/phi3/qwen3moe/
//! Mixtral GGUF models: plain loops over dequantized weights, its own metadata reading,
//! rope, attention and softmax. It shares no code with `Stage` or any backend; only the
//! GGUF reader and dequantizer are common. Gemma 2/3, Phi-3 and the MoE feed-forward follow
//! HF transformers' model definitions (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`,
//! `Phi3ForCausalLM`, `Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock`) and llama.cpp's
//! converter's tensor conventions.
//!
//! Keys and values are rounded to f16 before attention, because the model as served keeps
//! its KV cache in f16; everything else is f64.

use std::collections::HashMap;

use tether_gguf::GgufFile;

pub struct Reference {
    embd: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ff: usize,
    vocab: usize,
    eps: f64,
    rope_base: f64,
    rope_scale: f64,
    n_rot: usize,
    neox: bool,
    /// Gemma 2 and 3: scaled embedding, (1 + w) norms, post-norms, GELU gate, sliding
    /// windows (and Gemma 2's soft-caps).
    gemma: Option<Gemma>,
    /// YaRN (HF's `rope_type: yarn`): each pair's inverse frequency and the factor on cos
    /// and sin.
    yarn: Option<(Vec<f64>, f64)>,
    /// `(experts, experts used a token, expert width, renormalize the chosen weights)`.
    experts: Option<(usize, usize, usize, bool)>,
    w: HashMap<String, Vec<f64>>,
}

/// What Gemma 2's and 3's HF configs give beyond LLaMA's.
struct Gemma {
    /// Gemma 2 (else 3).
    v2: bool,
    sliding_window: usize,
    /// Gemma 3's `rope_local_base_freq`: the sliding layers' rope base (they take no
    /// scaling); Gemma 2's layers share one rope.
    local_base: Option<f64>,
    /// Gemma 2's `attn_logit_softcapping` and `final_logit_softcapping`.
    attn_cap: Option<f64>,
    final_cap: Option<f64>,
}

fn round_f16(x: f64) -> f64 {
    f64::from(half::f16::from_f64(x).to_f64() as f32)
}

impl Reference {
    pub fn load(file: &GgufFile) -> Reference {
        let arch = file.get_str("general.architecture").unwrap().to_string();
        let u = |k: &str| file.get_u64(&format!("{arch}.{k}")).map(|v| v as usize);
        let embd = u("embedding_length").unwrap();
        let heads = u("attention.head_count").unwrap();
        // Qwen3 states its head width; the others split the embedding among the heads.
        let head_dim = u("attention.key_length").unwrap_or(embd / heads);
        let mut w = HashMap::new();
        for t in file.tensors() {
            let mut f = vec![0f32; t.elements() as usize];
            tether_gguf::dequantize(t.ty, file.tensor_data(t), &mut f).unwrap();
            w.insert(t.name.clone(), f.into_iter().map(f64::from).collect());
        }
        let vocab = file.tensor("token_embd.weight").unwrap().dims[1] as usize;
        let scale = match file.get_str(&format!("{arch}.rope.scaling.type")) {
            Some("linear") => {
                1.0 / f64::from(
                    file.get_f32(&format!("{arch}.rope.scaling.factor"))
                        .unwrap(),
                )
            }
            _ => 1.0,
        };
        // Mixture of experts, as the GGUF keys describe it; Mixtral (llama) files give the
        // expert width as feed_forward_length.
        let experts = u("expert_count").filter(|&n| n > 0).map(|n| {
            let width = u("expert_feed_forward_length")
                .or(u("feed_forward_length"))
                .unwrap();
            let norm = file
                .get_bool(&format!("{arch}.expert_weights_norm"))
                .unwrap_or(true);
            (n, u("expert_used_count").unwrap(), width, norm)
        });
        Reference {
            experts,
            embd,
            layers: u("block_count").unwrap(),
            heads,
            kv_heads: u("attention.head_count_kv").unwrap_or(heads),
            head_dim,
            ff: u("feed_forward_length").unwrap(),
            vocab,
            eps: f64::from(
                file.get_f32(&format!("{arch}.attention.layer_norm_rms_epsilon"))
                    .unwrap(),
            ),
            rope_base: file
                .get_f32(&format!("{arch}.rope.freq_base"))
                .map_or(10000.0, f64::from),
            rope_scale: scale,
            n_rot: u("rope.dimension_count").unwrap_or(head_dim),
            neox: matches!(
                arch.as_str(),
                "qwen2" | "qwen3" | "gemma2" | "gemma3" | "phi3" | "qwen3moe"
            ),
            yarn: yarn_frequencies(file, &arch, u("rope.dimension_count").unwrap_or(head_dim)),
            gemma: arch.starts_with("gemma").then(|| Gemma {
                v2: arch == "gemma2",
                sliding_window: u("attention.sliding_window").unwrap(),
                local_base: (arch == "gemma3").then_some(10000.0),
                attn_cap: file
                    .get_f32(&format!("{arch}.attn_logit_softcapping"))
                    .map(f64::from),
                final_cap: file
                    .get_f32(&format!("{arch}.final_logit_softcapping"))
                    .map(f64::from),
            }),
            w,
        }
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    fn t(&self, name: &str) -> &[f64] {
        &self.w[name]
    }

    /// `W x` for W of `rows` rows of `x.len()` columns.
    fn mat(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let w = self.t(name);
        let cols = x.len();
        (0..w.len() / cols)
            .map(|r| {
                w[r * cols..(r + 1) * cols]
                    .iter()
                    .zip(x)
                    .map(|(a, b)| a * b)
                    .sum()
            })
            .collect()
    }

    fn norm(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let k = 1.0 / (ms + self.eps).sqrt();
        x.iter()
            .zip(self.t(name))
            .map(|(v, g)| v * k * self.norm_gain(*g))
            .collect()
    }

    /// The factor a stored norm weight applies. HF's Gemma RMSNorm multiplies by `1 + w`
    /// and llama.cpp's converter stores `w + 1`: undo the shift, then apply HF's formula.
    fn norm_gain(&self, stored: f64) -> f64 {
        if self.gemma.is_some() {
            let w_hf = stored - 1.0;
            1.0 + w_hf
        } else {
            stored
        }
    }

    /// A layer's matrix `name`, or rows `[first, first + rows)` of fused matrix `fused`
    /// (Phi-3's `qkv_proj` and `gate_up_proj` are concatenations along the output axis).
    fn proj(&self, name: &str, fused: (&str, usize, usize), x: &[f64]) -> Vec<f64> {
        if self.w.contains_key(name) {
            return self.mat(name, x);
        }
        let (fused, first, rows) = fused;
        let all = self.mat(fused, x);
        all[first..first + rows].to_vec()
    }

    /// Qwen3's QK-norm: each `head_dim` slice of `x` divided by its root mean square, then
    /// scaled by the weight `name` (`[head_dim]`, shared by the heads). Absent for llama/qwen2.
    fn per_head_norm(&self, name: &str, x: &mut [f64]) {
        let Some(g) = self.w.get(name) else {
            return;
        };
        for head in x.chunks_mut(self.head_dim) {
            let ms = head.iter().map(|v| v * v).sum::<f64>() / self.head_dim as f64;
            let k = 1.0 / (ms + self.eps).sqrt();
            head.iter_mut()
                .zip(g)
                .for_each(|(v, g)| *v *= k * self.norm_gain(*g));
        }
    }

    /// Whether layer `l` is a sliding-window layer: Gemma 3's
    /// `(layer_idx + 1) % sliding_window_pattern != 0` with a pattern of 6; Gemma 2's
    /// `not bool(layer_idx % 2)`.
    fn sliding(&self, l: usize) -> bool {
        match &self.gemma {
            Some(g) if g.v2 => l.is_multiple_of(2),
            Some(_) => !(l + 1).is_multiple_of(6),
            None => false,
        }
    }

    fn rope(&self, x: &mut [f64], n_heads: usize, pos: usize, sliding: bool) {
        let factors = self.w.get("rope_freqs.weight");
        let (base, scale) = match self.gemma.as_ref().and_then(|g| g.local_base) {
            Some(local) if sliding => (local, 1.0),
            _ => (self.rope_base, self.rope_scale),
        };
        for h in 0..n_heads {
            let head = &mut x[h * self.head_dim..(h + 1) * self.head_dim];
            for i in 0..self.n_rot / 2 {
                let mut theta =
                    pos as f64 * scale * base.powf(-((2 * i) as f64) / self.n_rot as f64);
                let mut m = 1.0;
                if let Some((inv_freq, attention_factor)) = &self.yarn {
                    theta = pos as f64 * inv_freq[i];
                    m = *attention_factor;
                }
                if let Some(f) = factors {
                    theta /= f[i];
                }
                let (a, b) = if self.neox {
                    (i, i + self.n_rot / 2)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (x0, x1) = (head[a], head[b]);
                let (c, sn) = (theta.cos() * m, theta.sin() * m);
                head[a] = x0 * c - x1 * sn;
                head[b] = x0 * sn + x1 * c;
            }
        }
    }

    /// `down(silu(g) * u)`.
    fn swiglu_mlp(&self, g: &[f64], u: &[f64], down: impl Fn(&[f64]) -> Vec<f64>) -> Vec<f64> {
        let act: Vec<f64> = g
            .iter()
            .zip(u)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        down(&act)
    }

    /// `W_x h` for expert `x` of the stacked tensor `name` (experts of `rows` rows).
    fn expert_mat(&self, name: &str, x: usize, rows: usize, h: &[f64]) -> Vec<f64> {
        let w = &self.t(name)[x * rows * h.len()..(x + 1) * rows * h.len()];
        w.chunks(h.len())
            .map(|row| row.iter().zip(h).map(|(a, b)| a * b).sum())
            .collect()
    }

    /// The sparse MoE block of HF transformers' Qwen3-MoE and Mixtral: router scores,
    /// softmax over all experts, the top k (the lower index first among equals), their
    /// probabilities renormalized to sum to 1 (Qwen3-MoE's norm_topk_prob; for Mixtral the
    /// same as a softmax over the top-k scores), and the weighted sum of those experts'
    /// SwiGLU MLPs.
    fn experts_ffn(&self, layer: usize, h: &[f64]) -> Vec<f64> {
        let (n_expert, k, width, norm) = self.experts.unwrap();
        let n = |s: &str| format!("blk.{layer}.{s}");
        let scores = self.mat(&n("ffn_gate_inp.weight"), h);
        assert_eq!(scores.len(), n_expert);
        let max = scores.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
        let probs: Vec<f64> = scores.iter().map(|s| (s - max).exp() / z).collect();
        let mut order: Vec<usize> = (0..n_expert).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        let chosen = &order[..k];
        let total: f64 = chosen.iter().map(|&x| probs[x]).sum();
        let mut out = vec![0.0; self.embd];
        for &x in chosen {
            let weight = if norm { probs[x] / total } else { probs[x] };
            let g = self.expert_mat(&n("ffn_gate_exps.weight"), x, width, h);
            let u = self.expert_mat(&n("ffn_up_exps.weight"), x, width, h);
            let y = self.swiglu_mlp(&g, &u, |a| {
                self.expert_mat(&n("ffn_down_exps.weight"), x, self.embd, a)
            });
            out.iter_mut().zip(&y).for_each(|(o, y)| *o += weight * y);
        }
        out
    }

    /// Logits `[tokens.len()][vocab]`.
    pub fn logits(&self, tokens: &[u32]) -> Vec<Vec<f64>> {
        let head = if self.w.contains_key("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        let final_cap = self.gemma.as_ref().and_then(|g| g.final_cap);
        self.normed_hidden(tokens)
            .iter()
            .map(|x| {
                let logits = self.mat(head, x);
                // Gemma 2: logits / cap, tanh, * cap.
                match final_cap {
                    Some(cap) => logits.iter().map(|l| (l / cap).tanh() * cap).collect(),
                    None => logits,
                }
            })
            .collect()
    }

    /// The last layer's output after the final norm, `[tokens.len()][embd]`: the head's
    /// input (Hugging Face's `last_hidden_state`).
    pub fn normed_hidden(&self, tokens: &[u32]) -> Vec<Vec<f64>> {
        let (e, hd) = (self.embd, self.head_dim);
        let table = self.t("token_embd.weight");
        // Gemma3TextScaledWordEmbedding multiplies by sqrt(hidden_size).
        let embed_scale = if self.gemma.is_some() {
            (e as f64).sqrt()
        } else {
            1.0
        };
        let mut xs: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&id| {
                table[id as usize * e..(id as usize + 1) * e]
                    .iter()
                    .map(|v| v * embed_scale)
                    .collect()
            })
            .collect();
        let (qd, kvd) = (self.heads * hd, self.kv_heads * hd);
        let bias = |name: String, v: &mut Vec<f64>| {
            if let Some(b) = self.w.get(&name) {
                v.iter_mut().zip(b).for_each(|(x, b)| *x += b);
            }
        };
        for l in 0..self.layers {
            let n = |s: &str| format!("blk.{l}.{s}");
            let mut qs = Vec::new();
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            let sliding = self.sliding(l);
            let qkv = n("attn_qkv.weight");
            for (pos, x) in xs.iter().enumerate() {
                let h = self.norm(&n("attn_norm.weight"), x);
                let mut q = self.proj(&n("attn_q.weight"), (&qkv, 0, qd), &h);
                let mut k = self.proj(&n("attn_k.weight"), (&qkv, qd, kvd), &h);
                let mut v = self.proj(&n("attn_v.weight"), (&qkv, qd + kvd, kvd), &h);
                bias(n("attn_q.bias"), &mut q);
                bias(n("attn_k.bias"), &mut k);
                bias(n("attn_v.bias"), &mut v);
                self.per_head_norm(&n("attn_q_norm.weight"), &mut q);
                self.per_head_norm(&n("attn_k_norm.weight"), &mut k);
                self.rope(&mut q, self.heads, pos, sliding);
                self.rope(&mut k, self.kv_heads, pos, sliding);
                qs.push(q);
                ks.push(k.into_iter().map(round_f16).collect::<Vec<_>>());
                vs.push(v.into_iter().map(round_f16).collect::<Vec<_>>());
            }
            let group = self.heads / self.kv_heads;
            for (pos, x) in xs.iter_mut().enumerate() {
                let mut att = vec![0.0; self.heads * hd];
                for h in 0..self.heads {
                    let kh = h / group;
                    let q = &qs[pos][h * hd..(h + 1) * hd];
                    // Gemma's scaling is query_pre_attn_scalar^-0.5, which is head_dim for
                    // the sizes tested here; everyone else's is head_dim^-0.5.
                    // Sliding layers see keys j with pos - j < sliding_window.
                    let first = match &self.gemma {
                        Some(g) if sliding => (pos + 1).saturating_sub(g.sliding_window),
                        _ => 0,
                    };
                    let scores: Vec<f64> = (first..=pos)
                        .map(|j| {
                            let k = &ks[j][kh * hd..(kh + 1) * hd];
                            let s = q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>()
                                / (hd as f64).sqrt();
                            // Gemma 2: tanh(s / cap) * cap after the scaling.
                            match self.gemma.as_ref().and_then(|g| g.attn_cap) {
                                Some(cap) => (s / cap).tanh() * cap,
                                None => s,
                            }
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let z: f64 = exps.iter().sum();
                    for (j, p) in (first..=pos).zip(&exps) {
                        let v = &vs[j][kh * hd..(kh + 1) * hd];
                        for d in 0..hd {
                            att[h * hd + d] += p / z * v[d];
                        }
                    }
                }
                let mut o = self.mat(&n("attn_output.weight"), &att);
                if self.gemma.is_some() {
                    o = self.norm(&n("post_attention_norm.weight"), &o);
                }
                x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
                let h = self.norm(&n("ffn_norm.weight"), x);
                let d = if self.experts.is_some() {
                    self.experts_ffn(l, &h)
                } else {
                    let (g, u) = if self.w.contains_key(&n("ffn_gate.weight")) {
                        let g = self.mat(&n("ffn_gate.weight"), &h);
                        (g, self.mat(&n("ffn_up.weight"), &h))
                    } else {
                        // Phi3MLP: gate_up_proj's output chunked in two, gate first.
                        let gu = self.mat(&n("ffn_up.weight"), &h);
                        (gu[..self.ff].to_vec(), gu[self.ff..].to_vec())
                    };
                    assert_eq!(g.len(), self.ff);
                    let act: Vec<f64> = g
                        .iter()
                        .zip(&u)
                        .map(|(g, u)| self.gate_activation(*g) * u)
                        .collect();
                    let mut d = self.mat(&n("ffn_down.weight"), &act);
                    if self.gemma.is_some() {
                        d = self.norm(&n("post_ffw_norm.weight"), &d);
                    }
                    d
                };
                x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
            }
        }
        xs.iter()
            .map(|x| self.norm("output_norm.weight", x))
            .collect()
    }

    /// Gemma's `gelu_pytorch_tanh`; SiLU for the others.
    fn gate_activation(&self, g: f64) -> f64 {
        if self.gemma.is_some() {
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3));
            0.5 * g * (1.0 + inner.tanh())
        } else {
            g / (1.0 + (-g).exp())
        }
    }

    /// Greedy continuation of `prompt` by `n` tokens, recomputing everything each step.
    pub fn greedy(&self, prompt: &[u32], n: usize) -> Vec<u32> {
        let mut toks = prompt.to_vec();
        let mut out = Vec::new();
        for _ in 0..n {
            let logits = self.logits(&toks);
            let last = logits.last().unwrap();
            let best = (0..last.len()).fold(0, |b, i| if last[i] > last[b] { i } else { b }) as u32;
            out.push(best);
            toks.push(best);
        }
        out
    }
}

impl Reference {
    /// Checks a backend's greedy continuation `got` of `prompt` against this reference:
    /// each token must be the reference's arg-max, or within three times `worst_abs` (the
    /// largest logit error measured) of it, a near-tie that error can flip; at most
    /// `max_near_ties` of those. Returns how many near-ties there were.
    pub fn check_greedy(
        &self,
        prompt: &[u32],
        got: &[u32],
        worst_abs: f64,
        max_near_ties: usize,
        what: &str,
    ) -> usize {
        let mut forced = prompt.to_vec();
        forced.extend(got);
        let logits = self.logits(&forced);
        let mut ties = 0;
        for (i, &tok) in got.iter().enumerate() {
            let row = &logits[prompt.len() - 1 + i];
            let best = (0..row.len()).fold(0, |b, j| if row[j] > row[b] { j } else { b });
            if best as u32 != tok {
                let gap = row[best] - row[tok as usize];
                assert!(
                    gap < 3.0 * worst_abs,
                    "{what}: step {i}: {tok} chosen, reference prefers {best} by {gap:.3e} (errors up to {worst_abs:.3e})"
                );
                ties += 1;
            }
        }
        assert!(
            ties <= max_near_ties,
            "{what}: {ties} near-ties in {} steps",
            got.len()
        );
        ties
    }
}

/// HF transformers' YaRN (`_compute_yarn_parameters`), from the paper: the correction
/// range of pair indices where a pair turns between beta_fast (32) and beta_slow (1) times
/// over the original context, a linear ramp over it mixing interpolated (`/ factor`) and
/// extrapolated inverse frequencies, and `0.1 ln(factor) + 1` on cos and sin.
fn yarn_frequencies(file: &GgufFile, arch: &str, dim: usize) -> Option<(Vec<f64>, f64)> {
    let key = |k: &str| format!("{arch}.rope.scaling.{k}");
    if file.get_str(&key("type")) != Some("yarn") {
        return None;
    }
    let factor = f64::from(file.get_f32(&key("factor")).unwrap());
    let orig = file.get_u64(&key("original_context_length")).unwrap() as f64;
    let base = f64::from(file.get_f32(&format!("{arch}.rope.freq_base")).unwrap());
    let correction_dim = |rotations: f64| {
        dim as f64 * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let low = correction_dim(32.0).floor().max(0.0);
    let high = correction_dim(1.0).ceil().min(dim as f64 - 1.0);
    let high = if high == low { high + 0.001 } else { high };
    let inv_freq = (0..dim / 2)
        .map(|i| {
            let extrapolation = 1.0 / base.powf((2 * i) as f64 / dim as f64);
            let interpolation = extrapolation / factor;
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0 - ramp;
            interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
        })
        .collect();
    Some((inv_freq, 0.1 * factor.ln() + 1.0))
}

/// ‖a − b‖ / ‖b‖.
pub fn relative_error(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - y).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}
