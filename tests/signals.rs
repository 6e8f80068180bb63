//! The tools' one signal path (`krafla::signals`) end to end: mlb-convert stops on
//! SIGTERM and SIGINT with exit 130 and leaves nothing behind. (SIGBUS: reliability.rs,
//! `mlb_run_model_truncated_while_running_fails_with_one_line`.)

use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use serde_json::json;

use crate::util::tool::tool;

/// A Llama checkpoint of 8 layers (dim 256, ~7M parameters in bf16), big enough that
/// converting it takes a while.
fn checkpoint(dir: &Path) {
    let (dim, hid, vocab, layers) = (256usize, 768usize, 2048usize, 8usize);
    let config = json!({
        "model_type": "llama", "hidden_size": dim, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": hid,
        "vocab_size": vocab, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": false
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut shapes = vec![
        ("model.embed_tokens.weight".to_string(), vec![vocab, dim]),
        ("lm_head.weight".to_string(), vec![vocab, dim]),
        ("model.norm.weight".to_string(), vec![dim]),
    ];
    for l in 0..layers {
        let p = format!("model.layers.{l}.");
        for (n, s) in [
            ("input_layernorm.weight", vec![dim]),
            ("post_attention_layernorm.weight", vec![dim]),
            ("self_attn.q_proj.weight", vec![dim, dim]),
            ("self_attn.k_proj.weight", vec![dim / 2, dim]),
            ("self_attn.v_proj.weight", vec![dim / 2, dim]),
            ("self_attn.o_proj.weight", vec![dim, dim]),
            ("mlp.gate_proj.weight", vec![hid, dim]),
            ("mlp.up_proj.weight", vec![hid, dim]),
            ("mlp.down_proj.weight", vec![dim, hid]),
        ] {
            shapes.push((p.clone() + n, s));
        }
    }
    let mut seed = 7u64;
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = shapes
        .into_iter()
        .map(|(n, s)| {
            let count: usize = s.iter().product();
            let bytes = (0..count)
                .flat_map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let v = ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
                    half::bf16::from_f32(v).to_le_bytes()
                })
                .collect();
            (n, s, bytes)
        })
        .collect();
    let views: Vec<(String, TensorView)> = data
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::BF16, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// Whether process `pid` catches signal `sig` (its SigCgt mask in /proc).
fn catches(pid: u32, sig: i32) -> bool {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    s.lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .is_some_and(|m| m & (1 << (sig - 1)) != 0)
}

#[test]
fn mlb_convert_stops_on_sigterm_and_sigint() {
    if !Path::new("/proc/self/status").exists() {
        eprintln!("skipped: no /proc here");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    std::fs::create_dir(&ck).unwrap();
    checkpoint(&ck);
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let out = dir.path().join("out.mlb");
        let child = tool("mlb-convert")
            .arg(&ck)
            .args([
                "--wtype",
                "q4_0",
                "--q4-rule",
                "search",
                "--threads",
                "1",
                "-o",
            ])
            .arg(&out)
            .spawn();
        let t0 = std::time::Instant::now();
        while !catches(child.id(), sig) {
            assert!(
                t0.elapsed().as_secs() < 30,
                "mlb-convert never installed its handler"
            );
            std::thread::yield_now();
        }
        // SAFETY: kill(2) on our own child, which is still running (not yet waited for).
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0);
        let o = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(130), "signal {sig}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(!err.contains("panicked"), "{err}");
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, ["ck"], "signal {sig}: the interrupted run left files");
    }
}
