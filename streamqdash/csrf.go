package streamqdash

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"net/http"
)

// csrfCookie holds a random value per browser; forms carry its HMAC.
const csrfCookie = "streamqdash_csrf"

// csrf issues and checks form tokens: a signed double-submit cookie. The
// cookie holds a random value; each form carries HMAC-SHA256(key, value).
// A cross-site page can neither read the cookie nor compute the HMAC without
// the key, and a cookie planted by a sibling subdomain comes without a
// matching token. It is the second line after the same-origin check of
// http.CrossOriginProtection.
type csrf struct {
	key []byte
}

// token returns the form token for this browser, setting its cookie first
// when it has none.
func (c csrf) token(w http.ResponseWriter, r *http.Request) string {
	v := ""
	if ck, err := r.Cookie(csrfCookie); err == nil && len(ck.Value) >= 22 {
		v = ck.Value
	} else {
		b := make([]byte, 24)
		_, _ = rand.Read(b)
		v = base64.RawURLEncoding.EncodeToString(b)
		// No Path: the browser scopes it to the dashboard's directory, which
		// the handler does not know (it may be mounted anywhere).
		http.SetCookie(w, &http.Cookie{Name: csrfCookie, Value: v, HttpOnly: true,
			Secure: r.TLS != nil, SameSite: http.SameSiteStrictMode})
	}
	return c.sign(v)
}

// existing returns the form token of the browser's cookie, or "" without
// one; it sets none. For api/queue: a cookie set there would be scoped to
// the api/ directory, which the POSTs to action never carry.
func (c csrf) existing(r *http.Request) string {
	if ck, err := r.Cookie(csrfCookie); err == nil && len(ck.Value) >= 22 {
		return c.sign(ck.Value)
	}
	return ""
}

func (c csrf) sign(v string) string {
	m := hmac.New(sha256.New, c.key)
	m.Write([]byte(v))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// check reports whether the request's form token matches its cookie.
func (c csrf) check(r *http.Request) bool {
	ck, err := r.Cookie(csrfCookie)
	if err != nil || ck.Value == "" {
		return false
	}
	return hmac.Equal([]byte(r.PostFormValue("csrf")), []byte(c.sign(ck.Value)))
}
