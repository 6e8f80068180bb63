//! The JSON of `POST /v1/embeddings` (OpenAI's `CreateEmbeddingRequest` and
//! `CreateEmbeddingResponse`): `input` as a string, a list of strings, a list of token
//! ids or a list of such lists; `encoding_format` `float` (default) or `base64`
//! (little-endian f32 bytes, what the `openai` client asks for); `dimensions` (the
//! first d values, before normalizing); and, as llama-server takes it, `normalize`
//! (default true: length 1). Each input is one sequence run through a slot like any
//! other request; the pooling is the server's (`--pooling`, else the model's).

use serde::Deserialize;
use serde_json::{json, Value as Json};

use super::api::{self, ApiError};
use crate::session::l2_normalize;

/// Most inputs in one request (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// One text to embed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// Encoded as the tokenizer encodes a text (with its BOS, if it adds one).
    Text(String),
    /// Token ids as given.
    Ids(Vec<u32>),
}

impl Input {
    /// Bytes of a text, ids of a list: what the request's budget sees before encoding.
    pub fn size(&self) -> usize {
        match self {
            Input::Text(t) => t.len(),
            Input::Ids(ids) => ids.len(),
        }
    }
}

/// An embeddings request, read and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbedRequest {
    pub inputs: Vec<Input>,
    /// Length 1 (the default).
    pub normalize: bool,
    /// Little-endian f32 bytes in base64, not a list of numbers.
    pub base64: bool,
    /// Keep the first this many values.
    pub dimensions: Option<usize>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Fields {
    input: Option<Json>,
    #[allow(dead_code)]
    model: Option<String>,
    encoding_format: Option<String>,
    dimensions: Option<i64>,
    normalize: Option<bool>,
    #[allow(dead_code)]
    user: Option<String>,
}

/// Reads `input`'s shapes.
fn inputs(v: Option<&Json>, vocab: usize) -> Result<Vec<Input>, ApiError> {
    let bad = |m: String| ApiError::invalid("input", m);
    let ids = |a: &[Json], at: &str| -> Result<Vec<u32>, ApiError> {
        if a.is_empty() {
            return Err(bad(format!("'{at}' is an empty list of token ids.")));
        }
        a.iter()
            .enumerate()
            .map(|(j, x)| {
                x.as_u64()
                    .filter(|&n| n < vocab as u64)
                    .map(|n| n as u32)
                    .ok_or_else(|| {
                        bad(format!(
                            "'{at}[{j}]' = {x}: token ids are integers below the model's vocabulary ({vocab})."
                        ))
                    })
            })
            .collect()
    };
    let text = |s: &str, at: &str| {
        if s.is_empty() {
            Err(bad(format!(
                "'{at}' is an empty string: there is nothing to embed."
            )))
        } else {
            Ok(Input::Text(s.to_string()))
        }
    };
    let list = match v {
        None | Some(Json::Null) => return Err(ApiError::missing("input")),
        Some(Json::String(s)) => return Ok(vec![text(s, "input")?]),
        Some(Json::Array(a)) => a,
        Some(other) => {
            return Err(bad(format!(
                "'input' = {other}: must be a string, a list of strings, a list of token ids or a list of lists of them."
            )))
        }
    };
    if list.is_empty() {
        return Err(bad("'input' is an empty list.".into()));
    }
    if list.len() > MAX_INPUTS {
        return Err(bad(format!(
            "'input' has {} items: at most {MAX_INPUTS}.",
            list.len()
        )));
    }
    if list.iter().all(Json::is_number) {
        return Ok(vec![Input::Ids(ids(list, "input")?)]);
    }
    list.iter()
        .enumerate()
        .map(|(i, x)| {
            let at = format!("input[{i}]");
            match x {
                Json::String(s) => text(s, &at),
                Json::Array(a) => ids(a, &at).map(Input::Ids),
                other => Err(bad(format!(
                    "'{at}' = {other}: must be a string or a list of token ids."
                ))),
            }
        })
        .collect()
}

/// Reads and checks a request body for a model of `vocab` ids and `dim` values.
pub fn parse(body: &[u8], vocab: usize, dim: usize) -> Result<EmbedRequest, ApiError> {
    let f: Fields = api::from_json(body)?;
    let base64 = match f.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("'encoding_format' = {other:?}: must be \"float\" or \"base64\"."),
            ))
        }
    };
    let dimensions = match f.dimensions {
        None => None,
        Some(d) if d >= 1 && d as u64 <= dim as u64 => Some(d as usize),
        Some(d) => {
            return Err(ApiError::invalid(
                "dimensions",
                format!("'dimensions' = {d}: must be between 1 and the model's {dim}."),
            ))
        }
    };
    Ok(EmbedRequest {
        inputs: inputs(f.input.as_ref(), vocab)?,
        normalize: f.normalize.unwrap_or(true),
        base64,
        dimensions,
    })
}

/// A pooled vector as the request asks: cut to `dimensions`, normalized.
pub fn finish(req: &EmbedRequest, mut v: Vec<f32>) -> Vec<f32> {
    if let Some(d) = req.dimensions {
        v.truncate(d);
    }
    if req.normalize {
        l2_normalize(&mut v);
    }
    v
}

/// Standard base64 (RFC 4648, with padding).
pub fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for k in 0..4 {
            if k <= c.len() {
                out.push(A[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The response: one `embedding` object per input, in order, and the usage (every id
/// run, `prompt_tokens` = `total_tokens`).
pub fn response(model: &str, req: &EmbedRequest, vectors: &[Vec<f32>], tokens: usize) -> Json {
    let data: Vec<Json> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = if req.base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64(&bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(body: &str) -> Option<String> {
        let e = parse(body.as_bytes(), 100, 8).expect_err(body);
        assert_eq!(e.status.as_u16(), 400, "{e}");
        e.param
    }

    #[test]
    fn every_input_shape() {
        let p = |b: &str| parse(b.as_bytes(), 100, 8).unwrap();
        assert_eq!(p(r#"{"input": "a"}"#).inputs, vec![Input::Text("a".into())]);
        assert_eq!(
            p(r#"{"input": ["a", "b"]}"#).inputs,
            vec![Input::Text("a".into()), Input::Text("b".into())]
        );
        assert_eq!(
            p(r#"{"input": [1, 2]}"#).inputs,
            vec![Input::Ids(vec![1, 2])]
        );
        assert_eq!(
            p(r#"{"input": [[1], [2, 3]]}"#).inputs,
            vec![Input::Ids(vec![1]), Input::Ids(vec![2, 3])]
        );
        let r = p(
            r#"{"input": "a", "encoding_format": "base64", "dimensions": 4, "normalize": false}"#,
        );
        assert!(r.base64 && !r.normalize);
        assert_eq!(r.dimensions, Some(4));
        assert!(p(r#"{"input": "a"}"#).normalize);
        for (body, want) in [
            (r#"{}"#, "input"),
            (r#"{"input": ""}"#, "input"),
            (r#"{"input": []}"#, "input"),
            (r#"{"input": [[]]}"#, "input"),
            (r#"{"input": [1, 100]}"#, "input"),
            (r#"{"input": [1, "a"]}"#, "input"),
            (r#"{"input": 3}"#, "input"),
            (
                r#"{"input": "a", "encoding_format": "f16"}"#,
                "encoding_format",
            ),
            (r#"{"input": "a", "dimensions": 9}"#, "dimensions"),
            (r#"{"input": "a", "dimensions": 0}"#, "dimensions"),
            (r#"{"input": "a", "normalize": 1}"#, "normalize"),
        ] {
            assert_eq!(param(body).as_deref(), Some(want), "{body}");
        }
    }

    #[test]
    fn base64_is_rfc_4648() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64(&[0xff, 0xfe]), "//4=");
    }
}
