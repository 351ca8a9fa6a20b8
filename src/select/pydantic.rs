//! pydantic 2.13's field validation as vLLM's `@config` dataclasses get it (lax mode,
//! `extra="forbid"`), and `str(ValidationError)` byte for byte as pydantic 2.13 prints it.
//!
//! Only what vLLM's `ParallelConfig` / `EPLBConfig` fields need: `int` (with `gt` / `ge`),
//! `bool`, string `Literal`s (optionally `| None`), `str`, and a nested dataclass. Inputs are
//! JSON values seen as Python objects (`json.loads`): objects keep their key order, `repr` follows
//! Python's rules (string quoting and escapes, `True` / `None`, float `repr`), truncated as
//! pydantic truncates it (over 50 bytes: the first 25 bytes, `...`, the last 24, cut at character
//! boundaries). Known limits: Python escapes unassigned code points (category Cn) in `repr`,
//! epcomm shows them as they are; JSON integers beyond 64 bits arrive as floats (serde_json), and
//! integers above `i64::MAX` saturate (Python's do not overflow; every bound still holds).

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Number;

/// A JSON value as the Python object `json.loads` makes of it (objects keep their order).
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Num(Number),
    Str(String),
    List(Vec<Json>),
    /// Keys in document order; a repeated key keeps its first place and its last value.
    Dict(Vec<(String, Json)>),
}

impl Json {
    /// serde_json's value of it (object keys sorted, a repeated key's last value).
    pub fn to_value(&self) -> serde_json::Value {
        use serde_json::Value;
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Bool(*b),
            Json::Num(n) => Value::Number(n.clone()),
            Json::Str(s) => Value::String(s.clone()),
            Json::List(l) => Value::Array(l.iter().map(Json::to_value).collect()),
            Json::Dict(d) => {
                Value::Object(d.iter().map(|(k, v)| (k.clone(), v.to_value())).collect())
            }
        }
    }
}

/// Parses `text` keeping object key order (serde_json's own `Map` sorts keys unless its
/// crate-wide `preserve_order` feature is on, which would reorder every JSON epcomm writes).
pub fn parse_ordered(text: &str) -> Result<Json, String> {
    serde_json::from_str(text).map_err(|e| e.to_string())
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Json, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

/// Builds a [`Json`] from serde_json's events, in document order.
struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E>(self, b: bool) -> Result<Json, E> {
        Ok(Json::Bool(b))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Json, E> {
        Ok(Json::Num(n.into()))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Json, E> {
        Ok(Json::Num(n.into()))
    }

    fn visit_f64<E: de::Error>(self, f: f64) -> Result<Json, E> {
        Number::from_f64(f)
            .map(Json::Num)
            .ok_or_else(|| E::custom(format!("{f} is not a JSON number")))
    }

    fn visit_str<E>(self, s: &str) -> Result<Json, E> {
        Ok(Json::Str(s.to_owned()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(v) = seq.next_element()? {
            items.push(v);
        }
        Ok(Json::List(items))
    }

    /// A repeated key keeps its first place and takes its last value, as a Python dict does.
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut items: Vec<(String, Json)> = Vec::new();
        while let Some((k, v)) = map.next_entry::<String, Json>()? {
            match items.iter_mut().find(|(key, _)| *key == k) {
                Some(slot) => slot.1 = v,
                None => items.push((k, v)),
            }
        }
        Ok(Json::Dict(items))
    }
}

impl Json {
    /// Python's `type(x).__name__` for the object `json.loads` makes.
    pub fn py_type(&self) -> &'static str {
        match self {
            Json::Null => "NoneType",
            Json::Bool(_) => "bool",
            Json::Num(n) if n.is_f64() => "float",
            Json::Num(_) => "int",
            Json::Str(_) => "str",
            Json::List(_) => "list",
            Json::Dict(_) => "dict",
        }
    }

    /// Python's `repr(x)`.
    pub fn repr(&self) -> String {
        match self {
            Json::Null => "None".into(),
            Json::Bool(true) => "True".into(),
            Json::Bool(false) => "False".into(),
            Json::Num(n) => match n.as_f64() {
                Some(f) if n.is_f64() => float_repr(f),
                _ => n.to_string(),
            },
            Json::Str(s) => str_repr(s),
            Json::List(items) => {
                let parts: Vec<String> = items.iter().map(Json::repr).collect();
                format!("[{}]", parts.join(", "))
            }
            Json::Dict(items) => {
                let parts: Vec<String> = items
                    .iter()
                    .map(|(k, v)| format!("{}: {}", str_repr(k), v.repr()))
                    .collect();
                format!("{{{}}}", parts.join(", "))
            }
        }
    }
}

/// Python's `repr(float)` (shortest round-trip digits; scientific below 1e-4 and from 1e16).
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    let n = digits.len() as i32;
    let body = if (-4..16).contains(&exp) {
        let point = exp + 1;
        if point >= n {
            format!("{digits}{}.0", "0".repeat((point - n) as usize))
        } else if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        }
    } else {
        let rest = if n > 1 {
            format!(".{}", &digits[1..])
        } else {
            String::new()
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{}{rest}e{esign}{:02}", &digits[..1], exp.abs())
    };
    format!("{sign}{body}")
}

/// Code points Python's `str.isprintable` rejects, besides unassigned ones (Unicode 14).
const NOT_PRINTABLE: [(u32, u32); 28] = [
    (0x0, 0x1F),
    (0x7F, 0xA0),
    (0xAD, 0xAD),
    (0x600, 0x605),
    (0x61C, 0x61C),
    (0x6DD, 0x6DD),
    (0x70F, 0x70F),
    (0x890, 0x891),
    (0x8E2, 0x8E2),
    (0x1680, 0x1680),
    (0x180E, 0x180E),
    (0x2000, 0x200F),
    (0x2028, 0x202F),
    (0x205F, 0x2064),
    (0x2066, 0x206F),
    (0x3000, 0x3000),
    (0xD800, 0xF8FF),
    (0xFEFF, 0xFEFF),
    (0xFFF9, 0xFFFB),
    (0x110BD, 0x110BD),
    (0x110CD, 0x110CD),
    (0x13430, 0x13438),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0001, 0xE0001),
    (0xE0020, 0xE007F),
    (0xF0000, 0xFFFFD),
    (0x100000, 0x10FFFD),
];

fn printable(c: char) -> bool {
    let cp = c as u32;
    !NOT_PRINTABLE
        .iter()
        .any(|&(lo, hi)| (lo..=hi).contains(&cp))
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`.
pub fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if printable(c) => out.push(c),
            c if (c as u32) < 0x100 => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if (c as u32) < 0x10000 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push_str(&format!("\\U{:08x}", c as u32)),
        }
    }
    out.push(quote);
    out
}

/// pydantic's cut of a long `input_value`: over 50 bytes, the first 25 bytes (back to a
/// character boundary), `...`, and the last 24 (forward to a character boundary).
pub fn truncate(repr: &str) -> String {
    if repr.len() <= 50 {
        return repr.to_owned();
    }
    let mut head = 25;
    while !repr.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = repr.len() - 24;
    while !repr.is_char_boundary(tail) {
        tail += 1;
    }
    format!("{}...{}", &repr[..head], &repr[tail..])
}

/// A failed check: pydantic's error type and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fail {
    pub kind: &'static str,
    pub msg: String,
}

fn fail(kind: &'static str, msg: impl Into<String>) -> Fail {
    Fail {
        kind,
        msg: msg.into(),
    }
}

/// One line error of a `ValidationError`.
#[derive(Debug, Clone, PartialEq)]
pub struct LineError {
    /// The dotted location (`eplb_config.window_size`).
    pub loc: String,
    pub fail: Fail,
    pub input: Json,
}

/// `str(ValidationError)` as pydantic 2.13 prints it for model `title`.
pub fn render(title: &str, errors: &[LineError]) -> String {
    let n = errors.len();
    let mut out = format!(
        "{n} validation error{} for {title}",
        if n == 1 { "" } else { "s" }
    );
    for e in errors {
        out.push_str(&format!(
            "\n{}\n  {} [type={}, input_value={}, input_type={}]\n    For further information visit https://errors.pydantic.dev/2.13/v/{}",
            e.loc,
            e.fail.msg,
            e.fail.kind,
            truncate(&e.input.repr()),
            e.input.py_type(),
            e.fail.kind
        ));
    }
    out
}

const INT_PARSING: &str = "Input should be a valid integer, unable to parse string as an integer";
const INT_SIZE: &str = "Unable to parse input string as an integer, exceeded maximum size";

/// Lax `int`: bools, whole floats and integer strings are accepted, as pydantic does.
pub fn int(v: &Json) -> Result<i64, Fail> {
    match v {
        Json::Bool(b) => Ok(i64::from(*b)),
        Json::Num(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Ok(i),
            // Python ints do not overflow: saturate (every bound still holds).
            (None, Some(_), _) => Ok(i64::MAX),
            (None, None, Some(f)) => float_as_int(f),
            (None, None, None) => Err(fail("int_type", "Input should be a valid integer")),
        },
        Json::Str(s) => str_as_int(s),
        Json::Null | Json::List(_) | Json::Dict(_) => {
            Err(fail("int_type", "Input should be a valid integer"))
        }
    }
}

fn float_as_int(f: f64) -> Result<i64, Fail> {
    if !f.is_finite() {
        Err(fail("finite_number", "Input should be a finite number"))
    } else if f % 1.0 != 0.0 {
        Err(fail(
            "int_from_float",
            "Input should be a valid integer, got a number with a fractional part",
        ))
    } else if (i64::MIN as f64) < f && f < (i64::MAX as f64) {
        Ok(f as i64)
    } else {
        Err(fail("int_parsing_size", INT_SIZE))
    }
}

/// pydantic's string-to-int: surrounding whitespace, a sign, `.000` and single `_` separators.
fn str_as_int(s: &str) -> Result<i64, Fail> {
    let s = s.trim();
    if s.len() > 4300 {
        return Err(fail("int_parsing_size", INT_SIZE));
    }
    let parse = |t: &str| -> Option<i64> {
        let digits = t.strip_prefix(['+', '-']).unwrap_or(t);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        // Beyond 64 bits Python still has an int: saturate.
        Some(t.parse::<i64>().unwrap_or(if t.starts_with('-') {
            i64::MIN
        } else {
            i64::MAX
        }))
    };
    let stripped_zeros = s
        .split_once('.')
        .filter(|(_, frac)| !frac.is_empty() && frac.bytes().all(|b| b == b'0'))
        .map(|(int, _)| int.to_owned());
    let candidate = if parse(s).is_some() {
        Some(s.to_owned())
    } else if stripped_zeros.is_some() {
        stripped_zeros
    } else if !s.starts_with('_') && !s.ends_with('_') && s.contains('_') && !s.contains("__") {
        Some(s.replace('_', ""))
    } else {
        None
    };
    candidate
        .as_deref()
        .and_then(parse)
        .ok_or_else(|| fail("int_parsing", INT_PARSING))
}

const BOOL_PARSING: &str = "Input should be a valid boolean, unable to interpret input";

/// Lax `bool`: 0 / 1 (int or float) and pydantic's words (`yes`, `off`, ...), case-insensitive.
pub fn bool(v: &Json) -> Result<bool, Fail> {
    let bad_type = || fail("bool_type", "Input should be a valid boolean");
    match v {
        Json::Bool(b) => Ok(*b),
        Json::Num(n) => match (n.as_i64(), n.as_f64()) {
            (Some(0), _) => Ok(false),
            (Some(1), _) => Ok(true),
            (Some(_), _) => Err(fail("bool_parsing", BOOL_PARSING)),
            (None, Some(f)) if n.is_f64() && f % 1.0 != 0.0 => Err(bad_type()),
            (None, Some(0.0)) => Ok(false),
            (None, Some(1.0)) => Ok(true),
            (None, _) => Err(fail("bool_parsing", BOOL_PARSING)),
        },
        Json::Str(s) => {
            let is = |words: &[&str]| words.iter().any(|w| s.eq_ignore_ascii_case(w));
            if s == "0" || is(&["f", "n", "no", "off", "false"]) {
                Ok(false)
            } else if s == "1" || is(&["t", "y", "on", "yes", "true"]) {
                Ok(true)
            } else {
                Err(fail("bool_parsing", BOOL_PARSING))
            }
        }
        Json::Null | Json::List(_) | Json::Dict(_) => Err(bad_type()),
    }
}

/// `str` (pydantic does not turn numbers into strings).
pub fn string(v: &Json) -> Result<String, Fail> {
    match v {
        Json::Str(s) => Ok(s.clone()),
        Json::Null | Json::Bool(_) | Json::Num(_) | Json::List(_) | Json::Dict(_) => {
            Err(fail("string_type", "Input should be a valid string"))
        }
    }
}

/// A `Literal` of strings: pydantic's `'a', 'b' or 'c'` list.
pub fn literal(v: &Json, members: &[&str]) -> Result<String, Fail> {
    match v {
        Json::Str(s) if members.contains(&s.as_str()) => Ok(s.clone()),
        Json::Null
        | Json::Bool(_)
        | Json::Num(_)
        | Json::Str(_)
        | Json::List(_)
        | Json::Dict(_) => {
            let quoted: Vec<String> = members.iter().map(|m| str_repr(m)).collect();
            let expected = match quoted.split_last() {
                Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
                Some((last, _)) => last.clone(),
                None => String::new(),
            };
            Err(fail("literal_error", format!("Input should be {expected}")))
        }
    }
}

/// `Field(gt=bound)`.
pub fn gt(n: i64, bound: i64) -> Result<i64, Fail> {
    if n > bound {
        Ok(n)
    } else {
        Err(fail(
            "greater_than",
            format!("Input should be greater than {bound}"),
        ))
    }
}

/// `Field(ge=bound)`.
pub fn ge(n: i64, bound: i64) -> Result<i64, Fail> {
    if n >= bound {
        Ok(n)
    } else {
        Err(fail(
            "greater_than_equal",
            format!("Input should be greater than or equal to {bound}"),
        ))
    }
}

/// A `list[...]` field given as something other than a list.
pub fn list_type() -> Fail {
    fail("list_type", "Input should be a valid list")
}

/// A field validator's `ValueError(msg)`, as pydantic wraps it.
pub fn value_error(msg: &str) -> Fail {
    fail("value_error", format!("Value error, {msg}"))
}

/// A nested dataclass given as something other than a dict.
pub fn dataclass_type(class: &str) -> Fail {
    fail(
        "dataclass_type",
        format!("Input should be a dictionary or an instance of {class}"),
    )
}

/// A keyword the dataclass does not declare (`extra="forbid"`).
pub fn unexpected_keyword() -> Fail {
    fail("unexpected_keyword_argument", "Unexpected keyword argument")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_is_pythons() {
        // Each pair: the value and Python 3.11's repr of it.
        let cases: [(f64, &str); 11] = [
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (123.456, "123.456"),
            (1.5e300, "1.5e+300"),
            (9.3e18, "9.3e+18"),
            (-0.0, "-0.0"),
            (2.0, "2.0"),
            (1234567890123456.7, "1234567890123456.8"),
        ];
        for (x, want) in cases {
            assert_eq!(float_repr(x), want, "{x:e}");
        }
    }

    #[test]
    fn str_repr_is_pythons() {
        assert_eq!(str_repr("it's"), "\"it's\"");
        assert_eq!(str_repr("a'b\""), "'a\\'b\"'");
        assert_eq!(
            str_repr("tab\tnew\nline\\ \u{0}\u{7f}\u{a0}\u{e9}\u{200b}\u{1f600}\u{e0001}"),
            "'tab\\tnew\\nline\\\\ \\x00\\x7f\\xa0\u{e9}\\u200b\u{1f600}\\U000e0001'"
        );
    }

    #[test]
    fn long_reprs_are_cut_at_character_boundaries() {
        let s = format!("'{}'", "a".repeat(48));
        assert_eq!(truncate(&s), s);
        let s = format!("'{}'", "\u{20ac}".repeat(17));
        assert_eq!(
            truncate(&s),
            format!("'{}...{}'", "\u{20ac}".repeat(8), "\u{20ac}".repeat(7))
        );
    }

    #[test]
    fn ordered_parse_keeps_key_order_and_the_last_duplicate() {
        let v = parse_ordered(r#"{"b": 1, "a": [true, null, "x\u00e9"], "b": 2.5}"#).unwrap();
        assert_eq!(v.repr(), "{'b': 2.5, 'a': [True, None, 'x\u{e9}']}");
    }
}
