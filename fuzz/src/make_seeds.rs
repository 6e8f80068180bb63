//! Writes the small seed corpora of the fuzz targets into `fuzz/seeds/<target>/`.
//! Run from `fuzz/`: `cargo run --release --bin make_seeds`.

use std::path::Path;

use krafla::format::mlb::header::{layer_flag, q8_class, wtype};
use krafla::synth::{
    linear_dims, qwen35_hybrid, synth_file, synth_mixed, tiny_header,
};
use krafla::format::mlb::{validate, Header, Layout};
use krafla::format::mli::Mli;
use krafla::format::mlt::Mlt;
use krafla::format::WType;

/// Seeds of gbnf_parse.
const GBNF_SEEDS: [(&str, &str); 3] = [
    (
        "json.gbnf",
        "root ::= object\nvalue ::= object | array | string | number | (\"true\" | \"false\" | \"null\") ws\nobject ::= \"{\" ws ( string \":\" ws value (\",\" ws string \":\" ws value)* )? \"}\" ws\narray ::= \"[\" ws ( value (\",\" ws value)* )? \"]\" ws\nstring ::= \"\\\"\" ( [^\"\\\\\\x7F\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4}) )* \"\\\"\" ws\nnumber ::= (\"-\"? ([0-9] | [1-9] [0-9]{0,15})) (\".\" [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws\nws ::= | \" \" | \"\\n\" [ \\t]{0,20}\n",
    ),
    (
        "repeat.gbnf",
        "# yes or no, then digits\nroot ::= (\"yes\" | \"no\") \", \" [0-9]{2,3} item*? [^]\nitem ::= ( | \"a\"+ ) <|im_end|>\n",
    ),
    ("nested.gbnf", "root ::= ((((\"a\" | \"b\")*) \"c\"?)+)\n"),
];

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("seeds")
        .join(target);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
}

/// Small headers with the features that change the layout.
fn mlb_shapes() -> Vec<(&'static str, Header, Vec<u8>)> {
    let mut t = tiny_header();
    t.n_layers = 1;
    t.vocab = 32;
    t.hidden_dim = 64;
    let mut v = vec![("plain_q8", t, vec![])];
    let mut h = t;
    h.scale_f16 = 1;
    h.shared_classifier = 1;
    h.qkv_bias = 1;
    v.push(("f16_tied_bias", h, vec![]));
    let mut h = t;
    h.wtype = wtype::Q4_0;
    h.q8_mask = q8_class::TOK_EMB;
    h.n_layers = 2;
    h.layer_flags = 1;
    h.sliding_window = 4;
    h.rope_local_theta = 10000.0;
    h.post_norms = 1;
    h.qk_norm = 1;
    v.push((
        "q4_layer_flags",
        h,
        vec![
            layer_flag::SLIDING | layer_flag::LOCAL_ROPE,
            layer_flag::NO_ROPE,
        ],
    ));
    let mut h = t;
    h.n_layers = 2;
    qwen35_hybrid(&mut h);
    v.push(("linear_attention", h, vec![layer_flag::LINEAR, 0]));
    let mut h = t;
    h.wtype = wtype::BF16;
    v.push(("bf16", h, vec![]));
    // Mixed: a type table after the layer flags, every type in turn.
    let mut h = t;
    h.wtype = wtype::MIXED;
    h.scale_f16 = 1;
    h.n_layers = 2;
    h.layer_flags = 1;
    linear_dims(&mut h);
    v.push(("mixed_linear", h, vec![layer_flag::LINEAR, 0]));
    v
}

/// The first `n` tokens of a real tokenizer with the first 200 merges among them.
fn shrink(m: &Mlt, n: usize) -> Mlt {
    let mut s = m.vocab_prefix(n);
    s.merges.truncate(200);
    s
}

fn main() {
    for (name, h, flags) in mlb_shapes() {
        let f = if h.wtype == wtype::MIXED {
            let d = validate(&h).unwrap();
            let n = Layout::matrix_count(&h, &d, &flags).unwrap();
            // The tiny shape's rows are 32-weight multiples: the K types (256-weight
            // super-blocks) cannot take them.
            let fit: Vec<WType> = WType::ALL
                .into_iter()
                .filter(|t| t.block_weights() <= 32)
                .collect();
            let types: Vec<WType> = (0..n).map(|i| fit[i % fit.len()]).collect();
            synth_mixed(&h, &flags, &types, 7)
        } else {
            synth_file(&h, &flags, 7)
        };
        krafla::format::mlb::parse(&f).unwrap_or_else(|e| panic!("{name}: {e}"));
        // mlb_view runs on these too (scripts/fuzz.sh).
        write("mlb_parse", &format!("{name}.mlb"), &f);
    }
    for (name, m) in krafla_fuzz::real_mlts() {
        let family = name.trim_end_matches(".json.gz").replace(".tokenizer", "");
        let small = shrink(&m, 600);
        let bytes = small.to_bytes().unwrap();
        Mlt::parse(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        write("mlt_parse", &format!("{family}.600.mlt"), &bytes);
    }
    let mut m = Mli::new(2, 32, 64, 64);
    for (i, s) in m.sums.iter_mut().enumerate() {
        *s = i as f64 * 0.5;
    }
    m.tokens = 10;
    m.cls_tokens = 7;
    write("mli_parse", "small.mli", &m.to_bytes());
    write(
        "mli_parse",
        "qdim_eq_dim.mli",
        &Mli::new(1, 32, 32, 32).to_bytes(),
    );
    let texts = [
        (
            "ascii",
            "Hello, world! The quick brown fox jumps over 12345 lazy dogs.",
        ),
        (
            "code",
            "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n\t\t  ",
        ),
        (
            "unicode",
            "Ünïcödé: 日本語のテキスト, emoji 🦀🎉, العربية, e\u{301}",
        ),
        (
            "special",
            "<|begin_of_text|><|im_start|>user\n<start_of_turn>hi<end_of_turn>",
        ),
        ("digits", "3.14159 1,000,000 ١٢٣ 0x7fff 2026-12-01"),
    ];
    for (name, t) in texts {
        write("tok_encode", &format!("{name}.txt"), t.as_bytes());
    }
    let ids: [&[u32]; 3] = [
        &[0, 1, 2, 3, 100, 200, 300, 1000, 5000],
        &[220, 220, 256, 257, 198, 50000, u32::MAX],
        &[3, 4, 5, 0xe2, 0x82, 0xac, 300],
    ];
    for (i, s) in ids.iter().enumerate() {
        let b: Vec<u8> = s.iter().flat_map(|i| i.to_le_bytes()).collect();
        write("tok_decode", &format!("ids{i}.bin"), &b);
    }
    // chat_render: each real template with a conversation; mlt_parse: a small
    // tokenizer with a chat section.
    let chat = krafla_fuzz::repo().join("testdata/chat");
    let conv = r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi {{ x }} <|im_end|>"}, {"role": "assistant", "content": "Hello!"}], "add_generation_prompt": true, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": 1.5}}}]}"#;
    let mut names: Vec<String> = std::fs::read_dir(chat.join("templates"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    names.sort();
    for n in &names {
        let mut b = std::fs::read(chat.join("templates").join(n)).unwrap();
        b.push(0);
        b.extend_from_slice(conv.as_bytes());
        write("chat_render", &format!("{n}.bin"), &b);
    }
    // Issue 42's hostile templates (testdata/hostile_templates.txt), one user message each.
    for (i, t) in include_str!("../../testdata/hostile_templates.txt")
        .lines()
        .enumerate()
    {
        let b = format!("{t}\0{{\"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}");
        write("chat_render", &format!("hostile-{i}.bin"), b.as_bytes());
    }
    // gbnf_parse: llama.cpp-style grammars (a JSON grammar's pieces, repetitions, escapes).
    for (name, g) in GBNF_SEEDS {
        write("gbnf_parse", name, g.as_bytes());
    }
    let (_, smol) = krafla_fuzz::real_mlts()
        .into_iter()
        .find(|(n, _)| n == "smollm2.tokenizer.json.gz")
        .expect("smollm2 tokenizer");
    let mut small = shrink(&smol, 600);
    let source = std::fs::read_to_string(chat.join("templates/smollm2.jinja")).unwrap();
    small.chat = krafla::chat::capture::build_section(
        &small,
        vec![krafla::format::mlt_chat::NamedTemplate {
            name: "default".into(),
            source,
        }],
        vec![("eos_token".into(), "<|im_end|>".into())],
        &[2],
        &[],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let bytes = small.to_bytes().unwrap();
    Mlt::parse(&bytes).unwrap();
    write("mlt_parse", "smollm2.600.chat.mlt", &bytes);
    // run_options: temp, top_p, top_k, seed, n_vocab, --tokens text, NUL, logits.
    let opts: [(f32, f32, u16, u64, u32, &str, &[f32]); 3] = [
        (0.8, 0.95, 40, 0, 96, "1 2 3", &[0.5, -1.0, 2.0, 0.0]),
        (
            0.0,
            1.0,
            0,
            42,
            4,
            "[0, 3]",
            &[1.0, 1.0, f32::NAN, f32::INFINITY],
        ),
        (
            1.5,
            0.1,
            1,
            7,
            1 << 24,
            "4294967295, 5",
            &[-1e30, 1e30, 3.0],
        ),
    ];
    for (i, (temp, top_p, top_k, seed, n_vocab, text, logits)) in opts.iter().enumerate() {
        let mut b = Vec::new();
        b.extend(temp.to_le_bytes());
        b.extend(top_p.to_le_bytes());
        b.extend(top_k.to_le_bytes());
        b.extend(seed.to_le_bytes());
        b.extend(n_vocab.to_le_bytes());
        b.extend(text.as_bytes());
        b.push(0);
        b.extend(logits.iter().flat_map(|x| x.to_le_bytes()));
        write("run_options", &format!("opts{i}.bin"), &b);
    }
    for (name, bytes) in gguf_seeds() {
        krafla::format::gguf::parse(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        krafla_fuzz::exercise_gguf(&bytes);
        write("gguf_parse", name, &bytes);
    }
    let models = krafla_fuzz::repo().join("testdata/models");
    let mut dirs: Vec<_> = std::fs::read_dir(&models)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    for d in dirs {
        if let Ok(c) = std::fs::read(d.join("config.json")) {
            let name = d.file_name().unwrap().to_string_lossy().into_owned();
            write("convert_config", &format!("{name}.json"), &c);
        }
    }
}

/// Small GGUF files: a tiny model with a tokenizer, and one block of every type.
fn gguf_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use krafla::format::gguf::{to_bytes, GgmlType, MetaValue, TensorSpec, ValueType};
    let s = |k: &str, v: &str| (k.to_string(), MetaValue::Str(v.into()));
    let u = |k: &str, v: u32| (k.to_string(), MetaValue::U32(v));
    let tokens: Vec<String> = (0..=255u8)
        .map(|b| {
            let c = if (0x21..=0x7e).contains(&b) {
                b as char
            } else {
                char::from_u32(0x100 + b as u32).unwrap()
            };
            c.to_string()
        })
        .collect();
    let kvs = vec![
        s("general.architecture", "llama"),
        u("llama.block_count", 1),
        u("llama.context_length", 64),
        u("llama.embedding_length", 32),
        u("llama.feed_forward_length", 32),
        u("llama.attention.head_count", 2),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            MetaValue::F32(1e-5),
        ),
        s("tokenizer.ggml.model", "gpt2"),
        s("tokenizer.ggml.pre", "gpt-2"),
        ("tokenizer.ggml.tokens".into(), MetaValue::strings(tokens)),
        (
            "tokenizer.ggml.merges".into(),
            MetaValue::strings(Vec::<String>::new()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            MetaValue::Array(ValueType::I32, vec![MetaValue::I32(1); 256]),
        ),
        u("tokenizer.ggml.bos_token_id", 1),
    ];
    let norm = vec![0u8; 32 * 4];
    let mat = vec![0u8; 32 * 34];
    let model = to_bytes(
        &kvs,
        &[
            (
                TensorSpec::vector("output_norm.weight", 32, GgmlType::F32),
                &norm[..],
            ),
            (
                TensorSpec::matrix("blk.0.attn_q.weight", 32, 32, GgmlType::Q8_0),
                &mat[..],
            ),
        ],
    )
    .unwrap();
    let types = [
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];
    let datas: Vec<(TensorSpec, Vec<u8>)> = types
        .iter()
        .map(|&t| {
            let spec = TensorSpec::vector(t.name(), t.block_size(), t);
            (
                spec,
                (0..t.block_bytes()).map(|i| (i * 37 % 251) as u8).collect(),
            )
        })
        .collect();
    let refs: Vec<(TensorSpec, &[u8])> = datas.iter().map(|(s, d)| (s.clone(), &d[..])).collect();
    let blocks = to_bytes(&[s("general.architecture", "types")], &refs).unwrap();
    vec![("tiny_model.gguf", model), ("types.gguf", blocks)]
}

