//! GGUF metadata arrays, held packed by element type.
//!
//! A file's arrays run to millions of elements (vocabularies, merges, and in hostile files
//! anything up to the file's size); one [`MetaValue`] an element would cost 32 bytes each, so
//! a 64 MiB header of short strings or bytes took several times its size in memory.

use std::fmt;

use crate::metadata::{MetaValue, type_id};

/// An array of metadata values, every element of one type (the element type is kept even
/// when the array is empty, so a file is written back as it was read).
#[derive(Clone, Debug, PartialEq)]
pub enum MetaArray {
    /// Elements of type 0.
    U8(Vec<u8>),
    /// Elements of type 1.
    I8(Vec<i8>),
    /// Elements of type 2.
    U16(Vec<u16>),
    /// Elements of type 3.
    I16(Vec<i16>),
    /// Elements of type 4.
    U32(Vec<u32>),
    /// Elements of type 5.
    I32(Vec<i32>),
    /// Elements of type 6.
    F32(Vec<f32>),
    /// Elements of type 7.
    Bool(Vec<bool>),
    /// Elements of type 8.
    String(Strings),
    /// Elements of type 9: arrays (real files use none).
    Array(Vec<MetaArray>),
    /// Elements of type 10.
    U64(Vec<u64>),
    /// Elements of type 11.
    I64(Vec<i64>),
    /// Elements of type 12.
    F64(Vec<f64>),
}

/// Many strings in one buffer: a vocabulary of 150,000 tokens is two allocations, not
/// 150,000.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Strings {
    text: String,
    /// End of each string in `text`.
    ends: Vec<usize>,
}

impl Strings {
    /// No strings, with room for `n`.
    pub fn with_capacity(n: usize) -> Self {
        Self {
            text: String::new(),
            ends: Vec::with_capacity(n),
        }
    }

    /// Appends `s`.
    pub fn push(&mut self, s: &str) {
        self.text.push_str(s);
        self.ends.push(self.text.len());
    }

    /// How many strings.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// String `i`.
    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        self.text.get(start..end)
    }

    /// Every string, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.len()).map(|i| self.get(i).unwrap_or_default())
    }
}

impl fmt::Debug for Strings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<S: AsRef<str>> FromIterator<S> for Strings {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Self {
        let mut out = Strings::default();
        for s in iter {
            out.push(s.as_ref());
        }
        out
    }
}

impl MetaArray {
    /// An array of strings.
    pub fn strings<S: AsRef<str>>(items: impl IntoIterator<Item = S>) -> Self {
        MetaArray::String(items.into_iter().collect())
    }

    /// How many elements.
    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::String(v) => v.len(),
            MetaArray::Array(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F64(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The GGUF type id of the elements.
    pub fn elem_type_id(&self) -> u32 {
        match self {
            MetaArray::U8(_) => type_id::U8,
            MetaArray::I8(_) => type_id::I8,
            MetaArray::U16(_) => type_id::U16,
            MetaArray::I16(_) => type_id::I16,
            MetaArray::U32(_) => type_id::U32,
            MetaArray::I32(_) => type_id::I32,
            MetaArray::F32(_) => type_id::F32,
            MetaArray::Bool(_) => type_id::BOOL,
            MetaArray::String(_) => type_id::STRING,
            MetaArray::Array(_) => type_id::ARRAY,
            MetaArray::U64(_) => type_id::U64,
            MetaArray::I64(_) => type_id::I64,
            MetaArray::F64(_) => type_id::F64,
        }
    }

    /// The lower-case name of the element type (`u32`, `string`, `array`).
    pub fn elem_type_name(&self) -> &'static str {
        type_id::name(self.elem_type_id())
    }

    /// Element `i` as a value of its own (a copy: for previews and tests, not for walking
    /// long arrays).
    pub fn get(&self, i: usize) -> Option<MetaValue> {
        Some(match self {
            MetaArray::U8(v) => MetaValue::U8(*v.get(i)?),
            MetaArray::I8(v) => MetaValue::I8(*v.get(i)?),
            MetaArray::U16(v) => MetaValue::U16(*v.get(i)?),
            MetaArray::I16(v) => MetaValue::I16(*v.get(i)?),
            MetaArray::U32(v) => MetaValue::U32(*v.get(i)?),
            MetaArray::I32(v) => MetaValue::I32(*v.get(i)?),
            MetaArray::F32(v) => MetaValue::F32(*v.get(i)?),
            MetaArray::Bool(v) => MetaValue::Bool(*v.get(i)?),
            MetaArray::String(v) => MetaValue::String(v.get(i)?.to_string()),
            MetaArray::Array(v) => MetaValue::Array(v.get(i)?.clone()),
            MetaArray::U64(v) => MetaValue::U64(*v.get(i)?),
            MetaArray::I64(v) => MetaValue::I64(*v.get(i)?),
            MetaArray::F64(v) => MetaValue::F64(*v.get(i)?),
        })
    }

    /// The strings of a string array.
    pub fn as_strings(&self) -> Option<&Strings> {
        match self {
            MetaArray::String(s) => Some(s),
            _ => None,
        }
    }

    /// Every element of an `F32` or `F64` array as `f32`.
    pub fn to_f32s(&self) -> Option<Vec<f32>> {
        match self {
            MetaArray::F32(v) => Some(v.clone()),
            MetaArray::F64(v) => Some(v.iter().map(|&x| x as f32).collect()),
            _ => None,
        }
    }

    /// Every element of an integer array, when all fit `i32`.
    pub fn to_i32s(&self) -> Option<Vec<i32>> {
        fn fit<T: Copy>(v: &[T]) -> Option<Vec<i32>>
        where
            i32: TryFrom<T>,
        {
            v.iter().map(|&x| i32::try_from(x).ok()).collect()
        }
        match self {
            MetaArray::U8(v) => fit(v),
            MetaArray::I8(v) => fit(v),
            MetaArray::U16(v) => fit(v),
            MetaArray::I16(v) => fit(v),
            MetaArray::U32(v) => fit(v),
            MetaArray::I32(v) => Some(v.clone()),
            MetaArray::U64(v) => fit(v),
            MetaArray::I64(v) => fit(v),
            _ => None,
        }
    }
}

impl fmt::Display for MetaArray {
    /// Every element, as [`MetaValue`] shows it (see `inspect` for abbreviation).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for i in 0..self.len() {
            if i > 0 {
                f.write_str(", ")?;
            }
            if let Some(item) = self.get(i) {
                write!(f, "{item}")?;
            }
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_keep_order_and_empties() {
        let s: Strings = ["a", "", "héllo"].into_iter().collect();
        assert_eq!(s.len(), 3);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec!["a", "", "héllo"]);
        assert_eq!(s.get(3), None);
        assert_eq!(format!("{s:?}"), r#"["a", "", "héllo"]"#);
    }

    #[test]
    fn conversions_respect_types_and_range() {
        assert_eq!(MetaArray::U32(vec![1, 2]).to_i32s(), Some(vec![1, 2]));
        assert_eq!(MetaArray::U32(vec![u32::MAX]).to_i32s(), None);
        assert_eq!(MetaArray::F64(vec![0.5]).to_f32s(), Some(vec![0.5]));
        assert_eq!(MetaArray::I32(vec![1]).to_f32s(), None);
        assert_eq!(MetaArray::U8(vec![]).elem_type_name(), "u8");
        assert_eq!(
            MetaArray::strings(["x"]).get(0),
            Some(MetaValue::String("x".into()))
        );
        assert_eq!(MetaArray::I16(vec![-1, 2]).to_string(), "[-1, 2]");
    }
}
