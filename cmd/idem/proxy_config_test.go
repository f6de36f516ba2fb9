package main

import (
	"reflect"
	"slices"
	"strings"
	"testing"
)

// TestRouteOverrideFields checks that routeOverride, the one list of a
// route's settings, is read whole: each of its fields (match aside), set
// alone, changes what apply returns, is named by settingsSet (methods
// aside) and routeFields, and every field of routeSettings is set by one
// of them.
func TestRouteOverrideFields(t *testing.T) {
	reached := map[string]bool{} // routeSettings fields some override changes
	settings := reflect.TypeFor[routeSettings]()
	for _, f := range reflect.VisibleFields(reflect.TypeFor[routeOverride]()) {
		name := yamlName(f)
		if name == "" {
			t.Errorf("routeOverride.%s: no yaml tag", f.Name)
			continue
		}
		if !strings.Contains(", "+routeFields+", ", ", "+name+", ") {
			t.Errorf("routeFields = %q, want it to name %s", routeFields, name)
		}
		if name == "match" {
			continue
		}
		if f.Type.Kind() != reflect.Pointer {
			t.Errorf("routeOverride.%s is a %v, want a pointer (nil: keep the flag's value)", f.Name, f.Type)
			continue
		}
		var o routeOverride
		reflect.ValueOf(&o).Elem().FieldByIndex(f.Index).Set(nonZero(f.Type.Elem()))
		if set := o.settingsSet(); name != "methods" && !slices.Equal(set, []string{name}) {
			t.Errorf("with only %s set, settingsSet() = %q, want [%s]", name, set, name)
		}
		got := reflect.ValueOf(o.apply(routeSettings{}))
		changed := false
		for _, sf := range reflect.VisibleFields(settings) {
			if !got.FieldByIndex(sf.Index).IsZero() {
				reached[sf.Name], changed = true, true
			}
		}
		if !changed {
			t.Errorf("with only %s set, apply changes nothing: give routeOverride.apply a case for %s", name, f.Name)
		}
	}
	for _, sf := range reflect.VisibleFields(settings) {
		if !reached[sf.Name] {
			t.Errorf("routeSettings.%s: no field of routeOverride sets it (a route setting the file cannot set)", sf.Name)
		}
	}
}

// nonZero returns a value of type t that is not its zero value: true, a
// non-empty string, 7777, a slice of one such element.
func nonZero(t reflect.Type) reflect.Value {
	v := reflect.New(t)
	switch t.Kind() {
	case reflect.Bool:
		v.Elem().SetBool(true)
	case reflect.String:
		v.Elem().SetString("X-Tenant")
	case reflect.Int, reflect.Int64:
		v.Elem().SetInt(7777)
	case reflect.Slice:
		v.Elem().Set(reflect.Append(reflect.MakeSlice(t, 0, 1), nonZero(t.Elem()).Elem()))
	default:
		panic("nonZero: add a case for " + t.String())
	}
	return v
}
