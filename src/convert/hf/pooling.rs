//! sentence-transformers' pooling config → the header's `pooling` hint.
//!
//! An embedding checkpoint saved by sentence-transformers lists its modules in
//! `modules.json`; its `sentence_transformers.models.Pooling` module's folder (usually
//! `1_Pooling/`) holds `config.json` with one `pooling_mode_*` flag set:
//! `pooling_mode_mean_tokens` → mean, `pooling_mode_lasttoken` → last token,
//! `pooling_mode_cls_token` → first token. Other modes (max, mean_sqrt_len,
//! weightedmean) or several at once have no code: the file names none, with a note.
//! A folder without modules.json (a plain decoder) names none.

use std::path::Path;

use serde_json::Value;

use crate::convert::error::{ConvertError, Result};
use crate::format::mlb::header::pooling;

/// The modes the header can name, by sentence-transformers' flag.
const MODES: [(&str, u32); 3] = [
    ("pooling_mode_mean_tokens", pooling::MEAN),
    ("pooling_mode_lasttoken", pooling::LAST),
    ("pooling_mode_cls_token", pooling::CLS),
];

fn read_json(file: &Path) -> Result<Option<Value>> {
    match std::fs::read_to_string(file) {
        Ok(t) => serde_json::from_str(&t)
            .map(Some)
            .map_err(|e| ConvertError::config(file, "(file)", "?", format!("not valid JSON: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ConvertError::io(file, e)),
    }
}

/// The pooling the checkpoint in `dir` asks for (module docs); `notes` gets a remark
/// when it asks for one the format cannot name.
pub fn pooling_of(dir: &Path, notes: &mut Vec<String>) -> Result<u32> {
    let modules_file = dir.join("modules.json");
    let Some(modules) = read_json(&modules_file)? else {
        return Ok(pooling::NONE);
    };
    let Some(list) = modules.as_array() else {
        return Err(ConvertError::config(
            &modules_file,
            "(file)",
            "?",
            "must be a list of modules",
        ));
    };
    let module = list.iter().find(|m| {
        m.get("type")
            .and_then(Value::as_str)
            .is_some_and(|t| t.ends_with("models.Pooling"))
    });
    let Some(path) = module.and_then(|m| m.get("path")).and_then(Value::as_str) else {
        return Ok(pooling::NONE);
    };
    // A module path is a folder name inside the checkpoint, never a way out of it.
    if Path::new(path)
        .components()
        .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(ConvertError::config(
            &modules_file,
            "path",
            path,
            "must be a folder inside the checkpoint",
        ));
    }
    let cfg_file = dir.join(path).join("config.json");
    let Some(cfg) = read_json(&cfg_file)? else {
        return Ok(pooling::NONE);
    };
    let on = |k: &str| cfg.get(k).and_then(Value::as_bool).unwrap_or(false);
    let set: Vec<&str> = cfg
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, v)| k.starts_with("pooling_mode_") && v.as_bool() == Some(true))
        .map(|(k, _)| k.as_str())
        .collect();
    match MODES.iter().find(|(k, _)| on(k)) {
        Some(&(_, code)) if set.len() == 1 => Ok(code),
        _ if set.is_empty() => Ok(pooling::NONE),
        _ => {
            notes.push(format!(
                "{}: pooling {} has no code in the .mlb header (mean, last token, first token): the file names none (servers pool by the last token unless told)",
                cfg_file.display(),
                set.join(" + ")
            ));
            Ok(pooling::NONE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(modules: Option<&str>, cfg: Option<&str>) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        if let Some(m) = modules {
            std::fs::write(d.path().join("modules.json"), m).unwrap();
        }
        if let Some(c) = cfg {
            std::fs::create_dir(d.path().join("1_Pooling")).unwrap();
            std::fs::write(d.path().join("1_Pooling/config.json"), c).unwrap();
        }
        d
    }

    const MODULES: &str = r#"[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]"#;

    #[test]
    fn modes_are_read() {
        let cfg = |k: &str| {
            format!(
                r#"{{"word_embedding_dimension": 64, "pooling_mode_cls_token": false, "pooling_mode_mean_tokens": false, "pooling_mode_lasttoken": false, "{k}": true}}"#
            )
        };
        for (k, want) in MODES {
            let d = folder(Some(MODULES), Some(&cfg(k)));
            let mut notes = Vec::new();
            assert_eq!(pooling_of(d.path(), &mut notes).unwrap(), want, "{k}");
            assert!(notes.is_empty());
        }
        // Max pooling has no code: none, with a note.
        let d = folder(Some(MODULES), Some(&cfg("pooling_mode_max_tokens")));
        let mut notes = Vec::new();
        assert_eq!(pooling_of(d.path(), &mut notes).unwrap(), pooling::NONE);
        assert!(notes[0].contains("pooling_mode_max_tokens"), "{notes:?}");
        // No modules.json, or no pooling module: none.
        let d = folder(None, None);
        assert_eq!(pooling_of(d.path(), &mut notes).unwrap(), pooling::NONE);
        let d = folder(Some("[]"), None);
        assert_eq!(pooling_of(d.path(), &mut notes).unwrap(), pooling::NONE);
        // Broken files are errors naming them.
        let d = folder(Some("{"), None);
        let e = pooling_of(d.path(), &mut notes).unwrap_err();
        assert!(e.to_string().contains("modules.json"), "{e}");
        let d = folder(Some(&MODULES.replace("1_Pooling\"", "../x\"")), None);
        assert!(pooling_of(d.path(), &mut notes).is_err());
    }
}
