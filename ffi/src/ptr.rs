//! Reading arguments from and writing results to caller memory. Every function here is
//! `unsafe` with the contract the public functions document: a pointer is NULL or valid for
//! what is read or written through it, for the duration of the call.

use std::ffi::{c_char, CStr};

use crate::error::{Error, Result, KVROUTE_RESULT_BUFFER_TOO_SMALL, KVROUTE_RESULT_INVALID_UTF8};

/// `*p` as a shared reference; `KVROUTE_RESULT_NULL_ARGUMENT` naming `name` if NULL.
///
/// # Safety
///
/// `p` is NULL or points to a live `T` that is not mutated for `'a`.
pub(crate) unsafe fn obj<'a, T>(p: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: the caller's contract.
    unsafe { p.as_ref() }.ok_or_else(|| Error::null(name))
}

fn utf8<'a>(bytes: &'a [u8], name: &str) -> Result<&'a str> {
    std::str::from_utf8(bytes).map_err(|e| {
        Error::new(KVROUTE_RESULT_INVALID_UTF8, format!("`{name}` is not valid UTF-8 (byte {})", e.valid_up_to()))
    })
}

/// A NUL-terminated UTF-8 string.
///
/// # Safety
///
/// `p` is NULL or points to a NUL-terminated string that outlives `'a`.
pub(crate) unsafe fn cstr<'a>(p: *const c_char, name: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::null(name));
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    let c = unsafe { CStr::from_ptr(p) };
    utf8(c.to_bytes(), name)
}

/// A NUL-terminated UTF-8 string, or `None` for NULL.
///
/// # Safety
///
/// As for [`cstr`].
pub(crate) unsafe fn opt_cstr<'a>(p: *const c_char, name: &str) -> Result<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    unsafe { cstr(p, name) }.map(Some)
}

/// `len` elements at `p` (NULL is allowed when `len` is 0).
///
/// # Safety
///
/// `p` is NULL or valid for reads of `len` elements that are not mutated for `'a`.
pub(crate) unsafe fn slice<'a, T>(p: *const T, len: usize, name: &str) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::null(name));
    }
    // SAFETY: non-NULL, valid for `len` elements by the caller's contract (which also bounds the
    // size by `isize::MAX`, as any C object is).
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// `len` bytes at `p` as UTF-8 text (NULL is allowed when `len` is 0).
///
/// # Safety
///
/// As for [`slice`].
pub(crate) unsafe fn text<'a>(p: *const c_char, len: usize, name: &str) -> Result<&'a str> {
    // SAFETY: forwarded contract.
    let bytes = unsafe { slice(p.cast::<u8>(), len, name) }?;
    utf8(bytes, name)
}

/// Checks an out-parameter before any work is done (so a NULL one changes nothing).
pub(crate) fn out<T>(p: *mut T, name: &str) -> Result<*mut T> {
    if p.is_null() {
        Err(Error::null(name))
    } else {
        Ok(p)
    }
}

/// Write `v` to an out-parameter checked by [`out`] (or an optional one, skipped if NULL).
///
/// # Safety
///
/// `p` is NULL or valid for one write of a `T`.
pub(crate) unsafe fn write<T>(p: *mut T, v: T) {
    if !p.is_null() {
        // SAFETY: non-NULL and valid by the caller's contract; `write` does not read or drop
        // the old (possibly uninitialized) value.
        unsafe { p.write(v) };
    }
}

/// Copy `bytes` (no terminator) into `buf`: the "strings out" convention without the NUL.
///
/// # Safety
///
/// `buf` is NULL or valid for writes of `buf_len` bytes; `needed` is NULL or valid for one
/// write.
pub(crate) unsafe fn copy_bytes(bytes: &[u8], buf: *mut u8, buf_len: usize, needed: *mut usize) -> Result<()> {
    if buf.is_null() && buf_len > 0 {
        return Err(Error::null("buf"));
    }
    // SAFETY: `needed` is NULL or valid by the caller's contract.
    unsafe { write(needed, bytes.len()) };
    if buf_len < bytes.len() {
        return Err(Error::new(
            KVROUTE_RESULT_BUFFER_TOO_SMALL,
            format!("a buffer of {buf_len} bytes is too small: {} needed", bytes.len()),
        ));
    }
    if !bytes.is_empty() {
        // SAFETY: `buf` is non-NULL (buf_len ≥ len ≥ 1) and valid for `buf_len` bytes; the
        // source is a Rust slice, which cannot overlap the caller's buffer.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len()) };
    }
    Ok(())
}

/// Copy `s` and a terminating NUL into `buf` (the "strings out" convention of the header).
/// `*needed` gets `s.len() + 1` on success and on `KVROUTE_RESULT_BUFFER_TOO_SMALL`; `buf` is
/// written only on success; `buf` may be NULL when `buf_len` is 0 (a size query).
///
/// # Safety
///
/// `buf` is NULL or valid for writes of `buf_len` bytes; `needed` is NULL or valid for one
/// write.
pub(crate) unsafe fn copy_str(s: &[u8], buf: *mut c_char, buf_len: usize, needed: *mut usize) -> Result<()> {
    if buf.is_null() && buf_len > 0 {
        return Err(Error::null("buf"));
    }
    let need = s.len() + 1;
    // SAFETY: `needed` is NULL or valid by the caller's contract.
    unsafe { write(needed, need) };
    if buf_len < need {
        return Err(Error::new(
            KVROUTE_RESULT_BUFFER_TOO_SMALL,
            format!("a buffer of {buf_len} bytes is too small: {need} needed"),
        ));
    }
    // SAFETY: `buf` is non-NULL (buf_len ≥ need ≥ 1) and valid for `buf_len ≥ s.len() + 1`
    // bytes; the source is a Rust slice, which cannot overlap caller-owned memory we write.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        buf.add(s.len()).write(0);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::KVROUTE_RESULT_NULL_ARGUMENT;

    #[test]
    fn copy_str_follows_the_strings_out_convention() {
        let mut buf = [b'#' as c_char; 8];
        let mut needed = 0usize;
        // SAFETY: local buffers of the sizes given.
        unsafe {
            assert_eq!(
                copy_str(b"abcdefgh", buf.as_mut_ptr(), 8, &mut needed).unwrap_err().code,
                KVROUTE_RESULT_BUFFER_TOO_SMALL
            );
            assert_eq!(needed, 9);
            assert!(buf.iter().all(|&c| c == b'#' as c_char), "untouched on failure");
            copy_str(b"abc", buf.as_mut_ptr(), 8, &mut needed).unwrap();
            assert_eq!(needed, 4);
            assert_eq!(&buf[..5], &[97, 98, 99, 0, b'#' as c_char]);
            needed = 0;
            assert_eq!(
                copy_str(b"abc", std::ptr::null_mut(), 0, &mut needed).unwrap_err().code,
                KVROUTE_RESULT_BUFFER_TOO_SMALL
            );
            assert_eq!(needed, 4);
            needed = 0;
            assert_eq!(
                copy_str(b"abc", std::ptr::null_mut(), 8, &mut needed).unwrap_err().code,
                KVROUTE_RESULT_NULL_ARGUMENT
            );
            assert_eq!(needed, 0, "not written on other failures");
            copy_str(b"", buf.as_mut_ptr(), 1, std::ptr::null_mut()).unwrap();
            assert_eq!(buf[0], 0);
        }
    }

    #[test]
    fn text_arguments() {
        let bad = [b'a', 0xff];
        // SAFETY: local arrays.
        unsafe {
            assert_eq!(text(bad.as_ptr().cast(), 2, "t").unwrap_err().code, KVROUTE_RESULT_INVALID_UTF8);
            assert_eq!(text(std::ptr::null(), 0, "t").unwrap(), "");
            assert_eq!(text(std::ptr::null(), 3, "t").unwrap_err().code, KVROUTE_RESULT_NULL_ARGUMENT);
            assert_eq!(cstr(c"hé".as_ptr(), "c").unwrap(), "hé");
            assert_eq!(opt_cstr(std::ptr::null(), "c").unwrap(), None);
        }
    }
}
