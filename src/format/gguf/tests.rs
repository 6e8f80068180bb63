//! The parser against crafted bytes (one test per refusal), and the writer against
//! hand-laid bytes and the parser.

use super::*;
use crate::format::Status;

/// Hand-laid GGUF bytes (independent of the writer).
#[derive(Clone)]
struct Raw {
    version: u32,
    kvs: Vec<Vec<u8>>,
    tensors: Vec<Vec<u8>>,
    /// Overrides of the counts.
    n_kv: Option<u64>,
    n_tensors: Option<u64>,
    align: usize,
    data: Vec<u8>,
}

fn s(b: &mut Vec<u8>, x: &[u8]) {
    b.extend_from_slice(&(x.len() as u64).to_le_bytes());
    b.extend_from_slice(x);
}

fn kv(key: &[u8], ty: u32, val: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    s(&mut b, key);
    b.extend_from_slice(&ty.to_le_bytes());
    b.extend_from_slice(val);
    b
}

fn kv_u32(key: &str, v: u32) -> Vec<u8> {
    kv(key.as_bytes(), 4, &v.to_le_bytes())
}

fn kv_str(key: &str, v: &str) -> Vec<u8> {
    let mut val = Vec::new();
    s(&mut val, v.as_bytes());
    kv(key.as_bytes(), 8, &val)
}

fn tensor(name: &[u8], dims: &[u64], ty: u32, offset: u64) -> Vec<u8> {
    let mut b = Vec::new();
    s(&mut b, name);
    b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
    for d in dims {
        b.extend_from_slice(&d.to_le_bytes());
    }
    b.extend_from_slice(&ty.to_le_bytes());
    b.extend_from_slice(&offset.to_le_bytes());
    b
}

impl Raw {
    /// The good file with one more key-value pair.
    fn with_kv(kv: Vec<u8>) -> Vec<u8> {
        let mut r = Raw::good();
        r.kvs.push(kv);
        r.bytes()
    }

    /// A valid file: two metadata entries, an F32 vector and a Q8_0 matrix.
    fn good() -> Raw {
        let mut data = vec![0u8; 64 * 4];
        data.extend_from_slice(&[0u8; 34 * 4]); // 2 rows × 64 cols of Q8_0 (2 blocks/row)
        Raw {
            version: 3,
            kvs: vec![
                kv_str("general.architecture", "llama"),
                kv_u32("llama.block_count", 1),
            ],
            tensors: vec![
                tensor(b"output_norm.weight", &[64], 0, 0),
                tensor(b"token_embd.weight", &[64, 2], 8, 256),
            ],
            n_kv: None,
            n_tensors: None,
            align: 32,
            data,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(
            &self
                .n_tensors
                .unwrap_or(self.tensors.len() as u64)
                .to_le_bytes(),
        );
        b.extend_from_slice(&self.n_kv.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        for k in &self.kvs {
            b.extend_from_slice(k);
        }
        for t in &self.tensors {
            b.extend_from_slice(t);
        }
        while b.len() % self.align != 0 {
            b.push(0);
        }
        b.extend_from_slice(&self.data);
        b
    }
}

/// The error of parsing `b`, with its status and rendered text.
fn err(b: &[u8]) -> (Status, String) {
    match parse(b) {
        Ok(_) => panic!("parsed"),
        Err(e) => (e.status, e.to_string()),
    }
}

fn assert_err(b: &[u8], status: Status, words: &[&str]) {
    let (st, text) = err(b);
    assert_eq!(st, status, "{text}");
    assert!(!text.contains('\n'), "one line: {text}");
    for w in words {
        assert!(text.contains(w), "{text:?} lacks {w:?}");
    }
}

#[test]
fn good_file_parses() {
    let b = Raw::good().bytes();
    let v = parse(&b).unwrap();
    assert_eq!(v.version, 3);
    assert_eq!(
        v.get("general.architecture").unwrap().as_str(),
        Some("llama")
    );
    assert_eq!(v.get("llama.block_count").unwrap().as_u64(), Some(1));
    let t = v.tensor("token_embd.weight").unwrap();
    assert_eq!((t.cols(), t.rows(), t.ty), (64, 2, GgmlType::Q8_0));
    assert_eq!(t.n_bytes, 136);
    assert_eq!(v.data(t).len(), 136);
    assert_eq!(t.offset, v.data_offset + 256);
    assert_eq!(v.data_offset % 32, 0);
}

#[test]
fn empty_magic_version() {
    assert_err(&[], Status::Format, &["empty"]);
    let mut b = Raw::good().bytes();
    b[0] = b'X';
    assert_err(&b, Status::Format, &["magic", "XGUF"]);
    let mut r = Raw::good();
    r.version = 1;
    assert_err(&r.bytes(), Status::Format, &["version = 1"]);
    r.version = 3u32.swap_bytes();
    assert_err(&r.bytes(), Status::Format, &["big-endian"]);
    assert_err(b"GGUF\x03\0\0", Status::Format, &["version", "truncated"]);
}

#[test]
fn counts_are_capped_before_allocating() {
    let mut r = Raw::good();
    r.n_kv = Some(u64::MAX / 2);
    assert_err(&r.bytes(), Status::Format, &["n_kv", "cannot fit"]);
    let mut r = Raw::good();
    r.n_tensors = Some(1 << 40);
    assert_err(&r.bytes(), Status::Format, &["n_tensors", "cannot fit"]);
    // Truncated in the middle of the metadata.
    let b = Raw::good().bytes();
    assert_err(
        &b[..150],
        Status::Format,
        &["output_norm.weight", "truncated"],
    );
}

#[test]
fn keys_and_values() {
    let one = 1u32.to_le_bytes();
    let bad_type = &["x.type = 13", "unknown value type"];
    let duplicate = &["llama.block_count = 2", "duplicate key"];
    for (pair, words) in [
        (kv(b"bad\xff", 4, &one), &["not UTF-8"][..]),
        (kv(b"", 4, &one), &["empty key"]),
        (kv(b"x.type", 13, &[]), bad_type),
        (kv(b"x.flag", 7, &[2]), &["x.flag = 2", "bool"]),
        (kv_u32("llama.block_count", 2), duplicate),
    ] {
        assert_err(&Raw::with_kv(pair), Status::Format, words);
    }
}

#[test]
fn string_length_past_the_end() {
    let mut val = Vec::new();
    val.extend_from_slice(&(1u64 << 50).to_le_bytes());
    assert_err(
        &Raw::with_kv(kv(b"general.name", 8, &val)),
        Status::Format,
        &["general.name", "length 1125899906842624", "left"],
    );
}

#[test]
fn arrays() {
    // Nested.
    let mut val = 9u32.to_le_bytes().to_vec();
    val.extend_from_slice(&0u64.to_le_bytes());
    assert_err(
        &Raw::with_kv(kv(b"x.nested", 9, &val)),
        Status::Format,
        &["x.nested", "nested arrays"],
    );
    // A count the file cannot hold.
    let mut val = 4u32.to_le_bytes().to_vec();
    val.extend_from_slice(&(u64::MAX / 3).to_le_bytes());
    assert_err(
        &Raw::with_kv(kv(b"x.big", 9, &val)),
        Status::Format,
        &["x.big", "array longer"],
    );
    // A string element running past the end.
    let mut val = 8u32.to_le_bytes().to_vec();
    val.extend_from_slice(&1u64.to_le_bytes());
    val.extend_from_slice(&1000u64.to_le_bytes());
    assert_err(
        &Raw::with_kv(kv(b"tokenizer.ggml.tokens", 9, &val)),
        Status::Format,
        &["tokenizer.ggml.tokens", "length 1000"],
    );
    // A good one reads back.
    let mut r = Raw::good();
    let mut val = 8u32.to_le_bytes().to_vec();
    val.extend_from_slice(&2u64.to_le_bytes());
    s(&mut val, b"a");
    s(&mut val, b"bc");
    r.kvs.push(kv(b"tokenizer.ggml.tokens", 9, &val));
    let b = r.bytes();
    let v = parse(&b).unwrap();
    let a = v.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap();
    let items: Vec<_> = a.iter().map(|x| x.as_str().unwrap().to_string()).collect();
    assert_eq!(items, ["a", "bc"]);
}

#[test]
fn alignment() {
    assert_err(
        &Raw::with_kv(kv_u32("general.alignment", 24)),
        Status::Format,
        &["general.alignment = 24", "power of two"],
    );
    assert_err(
        &Raw::with_kv(kv(b"general.alignment", 10, &64u64.to_le_bytes())),
        Status::Format,
        &["general.alignment", "u64"],
    );
    // 64 works, and moves the data section.
    let mut r = Raw::good();
    r.kvs.push(kv_u32("general.alignment", 64));
    r.align = 64;
    let b = r.bytes();
    let v = parse(&b).unwrap();
    assert_eq!((v.alignment, v.data_offset % 64), (64, 0));
}

#[test]
fn tensor_infos() {
    use Status::{Format, Shape};
    let bad = |t: Vec<u8>| {
        let mut r = Raw::good();
        r.tensors[1] = t;
        r.bytes()
    };
    // The matrix's info as a Q8_0 matrix at the data's start, other name and dims.
    let q8 = |name: &[u8], dims: &[u64]| bad(tensor(name, dims, 8, 256));
    assert_err(&q8(&[b'a'; 64], &[64, 2]), Format, &["longer than 63"]);
    assert_err(&q8(b"t\xfe", &[64, 2]), Format, &["not UTF-8"]);
    assert_err(&q8(b"t", &[]), Shape, &["t = n_dims 0"]);
    assert_err(&q8(b"t", &[32; 5]), Shape, &["n_dims 5"]);
    assert_err(&q8(b"t", &[64, 0]), Shape, &["t = [64, 0]", "zero"]);
    assert_err(
        &bad(tensor(b"t", &[1 << 32, 1 << 32], 0, 256)),
        Shape,
        &["overflows"],
    );
    assert_err(
        &bad(tensor(b"t", &[64, 2], 4, 256)),
        Format,
        &["t = type 4", "unknown ggml type"],
    );
    assert_err(
        &q8(b"t", &[48, 2]),
        Shape,
        &["t = [48, 2]", "block size 32"],
    );
    assert_err(
        &bad(tensor(b"t", &[64, 2], 8, 250)),
        Format,
        &["t = offset 250", "alignment 32"],
    );
    assert_err(
        &q8(b"output_norm.weight", &[64, 2]),
        Format,
        &["output_norm.weight", "duplicate tensor name"],
    );
    assert_err(
        &q8(b"t", &[64, 4]),
        Format,
        &["t = offset 256 + 272 bytes", "past the end"],
    );
    // The data section itself missing.
    let mut r = Raw::good();
    r.data.clear();
    let b = r.bytes();
    assert_err(&b[..b.len() - 1], Status::Format, &["data"]);
}

#[test]
fn writer_matches_hand_laid_bytes_and_is_deterministic() {
    let kvs = vec![
        (
            "general.architecture".to_string(),
            MetaValue::Str("llama".into()),
        ),
        ("llama.block_count".to_string(), MetaValue::U32(1)),
    ];
    let norm = [0u8; 256];
    let emb = [0u8; 136];
    let tensors = [
        (
            TensorSpec::vector("output_norm.weight", 64, GgmlType::F32),
            &norm[..],
        ),
        (
            TensorSpec::matrix("token_embd.weight", 2, 64, GgmlType::Q8_0),
            &emb[..],
        ),
    ];
    let a = to_bytes(&kvs, &tensors).unwrap();
    let mut want = Raw::good().bytes();
    // The writer pads the last tensor too.
    while !want.len().is_multiple_of(32) {
        want.push(0);
    }
    assert_eq!(a, want);
    assert_eq!(to_bytes(&kvs, &tensors).unwrap(), a);
}

#[test]
fn writer_round_trips_every_value_type() {
    let kvs: Vec<(String, MetaValue)> = vec![
        ("a.u8".into(), MetaValue::U8(200)),
        ("a.i8".into(), MetaValue::I8(-3)),
        ("a.u16".into(), MetaValue::U16(60000)),
        ("a.i16".into(), MetaValue::I16(-30000)),
        ("a.u32".into(), MetaValue::U32(4_000_000_000)),
        ("a.i32".into(), MetaValue::I32(-7)),
        ("a.f32".into(), MetaValue::F32(1.5)),
        ("a.bool".into(), MetaValue::Bool(true)),
        ("a.str".into(), MetaValue::Str("héllo".into())),
        ("a.u64".into(), MetaValue::U64(1 << 40)),
        ("a.i64".into(), MetaValue::I64(-(1 << 40))),
        ("a.f64".into(), MetaValue::F64(0.1)),
        ("a.strs".into(), MetaValue::strings(["x", "", "yz"])),
        (
            "a.bools".into(),
            MetaValue::Array(
                ValueType::Bool,
                vec![MetaValue::Bool(false), MetaValue::Bool(true)],
            ),
        ),
        ("general.alignment".into(), MetaValue::U32(64)),
    ];
    let data = [1u8, 2, 3, 4, 5, 6, 7, 8];
    let t = [(TensorSpec::vector("v", 4, GgmlType::BF16), &data[..])];
    let b = to_bytes(&kvs, &t).unwrap();
    let v = parse(&b).unwrap();
    assert_eq!(v.alignment, 64);
    for ((k, want), got) in kvs.iter().zip(&v.kvs) {
        assert_eq!(k, got.key);
        assert_eq!(&MetaValue::from_value(&got.value), want, "{k}");
    }
    assert_eq!(v.data(v.tensor("v").unwrap()), &data);
    // Mixed arrays, duplicate keys and short data are refused.
    let mixed = [(
        "x".to_string(),
        MetaValue::Array(ValueType::U32, vec![MetaValue::U8(1)]),
    )];
    assert!(to_bytes(&mixed, &[]).is_err());
    let dup = [
        ("x".to_string(), MetaValue::U8(1)),
        ("x".to_string(), MetaValue::U8(2)),
    ];
    assert!(to_bytes(&dup, &[]).is_err());
    let mut w = GgufWriter::new(
        Vec::new(),
        &[],
        vec![TensorSpec::vector("v", 4, GgmlType::F32)],
    )
    .unwrap();
    w.write_data(&[0; 8]).unwrap();
    assert!(w.finish().is_err());
}
